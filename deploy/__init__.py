"""Running NeoPP past one server: the load balancer's rules, local replicas, Kubernetes manifests."""
