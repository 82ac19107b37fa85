"""Command-line tools that run without a server: KV replay, and the writer of the model
repository's input/output blocks (``contract_configs``)."""
