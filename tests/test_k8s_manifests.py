"""The Kubernetes manifests render with kubectl kustomize and validate against the real schemas.

Each overlay is rendered as an operator would render it, every object is checked strictly
against Kubernetes 1.32's OpenAPI schemas (kubernetes-validate: the API server's own schemas,
offline), and the properties the deployment relies on are read from the rendered objects.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from deploy.router import MAX_GRPC_MESSAGE, MAX_REPLICAS, NAMESPACE, STATS_PAGE, STATS_PORT, render_kubernetes
from neopp.serving.model_io import generation_models

ROOT = Path(__file__).resolve().parents[1]
KUBE = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (KUBE / "overlays").iterdir())
VERSION = "1.32.0"

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize) is not installed")


def render(overlay: str) -> dict[tuple[str, str], dict]:
    out = subprocess.run(["kubectl", "kustomize", str(KUBE / "overlays" / overlay)], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out) if d}


def container(objects: dict, kind: str = "StatefulSet", name: str = "neopp") -> dict:
    return objects[kind, name]["spec"]["template"]["spec"]["containers"][0]


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_valid_kubernetes(overlay):
    objects = render(overlay)
    assert {kind for kind, _ in objects} == {"Namespace", "ConfigMap", "StatefulSet", "Deployment", "Service",
                                             "PersistentVolumeClaim", "PodDisruptionBudget", "HorizontalPodAutoscaler",
                                             "NetworkPolicy"}
    assert all(o["metadata"].get("namespace") == NAMESPACE for (kind, _), o in objects.items() if kind != "Namespace")
    for obj in objects.values():
        kubernetes_validate.validate(obj, VERSION, strict=True)


def test_the_validation_refuses_a_misspelt_field():
    deployment = render("cpu")["StatefulSet", "neopp"]
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 60
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_replica_drains_before_it_stops_and_is_ready_only_with_its_models(overlay):
    objects = render(overlay)
    spec = objects["StatefulSet", "neopp"]["spec"]
    pod, c = spec["template"]["spec"], container(objects)
    drain = float(env_of(c)["NEOPP_STOP_TIMEOUT_S"]["value"])  # the launcher's --stop-timeout-s
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    # the launcher gives running requests `drain` s, then the stubs 20 s more (supervisor._stop_server)
    assert pod["terminationGracePeriodSeconds"] > pre_stop + drain + 20, "the kubelet must not kill a draining replica"
    assert spec["serviceName"] == "neopp-replicas" and spec["updateStrategy"]["type"] == "RollingUpdate"
    assert c["readinessProbe"]["exec"]["command"][-1] == "/opt/neopp/docker/ready.py"
    # liveness reads the launcher's alive file: a door full of idle connections is not a dead replica
    assert c["livenessProbe"]["exec"]["command"][-1] == c["startupProbe"]["exec"]["command"][-1] \
        == "/opt/neopp/docker/live.py"
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 600
    assert env_of(c)["NEOPP_ADMIN_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "neopp-admin-key"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["checkpoints"]["persistentVolumeClaim"] == {"claimName": "neopp-checkpoints", "readOnly": True}
    models = env_of(c)["NEOPP_MODELS"]["value"].split()
    assert set(models) <= {p.parent.name for p in (ROOT / "model_repository").glob("*/config.pbtxt")}
    assert objects["PodDisruptionBudget", "neopp"]["spec"]["minAvailable"] == 1


def test_the_gpu_overlay_takes_a_node_of_eight_h200_with_every_model():
    objects = render("h200x8")
    c = container(objects)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert env_of(c)["NEOPP_CONFIG"]["value"] == "h200x8"
    assert set(generation_models(ROOT / "model_repository")) <= set(env_of(c)["NEOPP_MODELS"]["value"].split())
    on_gpus = [m for m in env_of(c)["NEOPP_MODELS"]["value"].split() if m != "neopp_session"]  # BLS: CPU
    assert all((ROOT / "model_repository" / m / "configs" / "h200x8.pbtxt").is_file() for m in on_gpus)


def test_the_router_runs_the_routing_rules_and_fronts_the_clients_service():
    objects = render("cpu")
    config = next(o for (kind, name), o in objects.items() if kind == "ConfigMap" and name.startswith("neopp-router"))
    assert config["data"]["haproxy.cfg"] == render_kubernetes(), "run make router-config"
    scaler = objects["HorizontalPodAutoscaler", "neopp"]["spec"]
    assert scaler["maxReplicas"] <= MAX_REPLICAS and scaler["scaleTargetRef"]["kind"] == "StatefulSet"
    named = r"server r(\d+) neopp-(\d+)\.neopp-replicas\.neopp\.svc\.cluster\.local:8001"
    servers = re.findall(named, config["data"]["haproxy.cfg"])  # slot I is pod I in every router pod
    assert [int(a) for a, b in servers] == [int(b) for a, b in servers] == list(range(MAX_REPLICAS))
    router = objects["Deployment", "neopp-router"]["spec"]["template"]["spec"]
    assert router["volumes"][0]["configMap"]["name"] == config["metadata"]["name"]
    assert objects["Service", "neopp"]["spec"]["selector"] == {"app.kubernetes.io/name": "neopp-router"}
    replicas = objects["Service", "neopp-replicas"]["spec"]
    assert replicas["clusterIP"] == "None" and replicas["selector"] == {"app.kubernetes.io/name": "neopp"}
    if shutil.which("haproxy"):
        path = Path(subprocess.run(["mktemp"], capture_output=True, text=True, check=True).stdout.strip())
        try:
            path.write_text(render_kubernetes())
            subprocess.run(["haproxy", "-c", "-f", str(path)], check=True, capture_output=True, timeout=30)
        finally:
            path.unlink()


def pod_of(objects: dict, kind: str, name: str) -> dict:
    return objects[kind, name]["spec"]["template"]["spec"]


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("workload", [("StatefulSet", "neopp"), ("Deployment", "neopp-router")])
def test_every_pod_runs_unprivileged_with_a_read_only_root(overlay, workload):
    objects = render(overlay)
    pod = pod_of(objects, *workload)
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    for c in pod["containers"]:
        ctx = c["securityContext"]
        assert ctx["allowPrivilegeEscalation"] is False and ctx["privileged"] is False
        assert ctx["readOnlyRootFilesystem"] is True and ctx["capabilities"] == {"drop": ["ALL"]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_replica_runs_as_the_images_user_and_writes_only_its_volumes(overlay):
    objects = render(overlay)
    pod, c = pod_of(objects, "StatefulSet", "neopp"), container(objects)
    (user,) = re.findall(r"^USER (\d+):(\d+)$", (ROOT / "docker" / "Dockerfile").read_text(), re.MULTILINE)
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == tuple(map(int, user))
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    for path in ("/var/lib/neopp", "/tmp", "/dev/shm"):  # the state dir (docker/Dockerfile), scratch, IPC
        assert "emptyDir" in volumes[mounts[path]], path


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_key_is_ever_on_a_command_line(overlay):
    """The keys reach the launcher through the environment, from Secrets; no command, argument or
    probe names them (Kubernetes would expand $(VAR) into a process's arguments)."""
    objects = render(overlay)
    for workload in (("StatefulSet", "neopp"), ("Deployment", "neopp-router")):
        for c in pod_of(objects, *workload)["containers"]:
            lines = [*c.get("command", []), *c.get("args", [])]
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                lines += c.get(probe, {}).get("exec", {}).get("command", [])
            assert not any("KEY" in part.upper() for part in lines), lines
    env = env_of(container(objects))
    for name, secret in (("NEOPP_ADMIN_KEY", "neopp-admin-key"), ("NEOPP_API_KEY", "neopp-api-key")):
        assert env[name]["valueFrom"]["secretKeyRef"]["name"] == secret and "value" not in env[name]


def test_only_the_router_reaches_the_replicas():
    objects = render("cpu")
    router_labels = objects["Deployment", "neopp-router"]["spec"]["template"]["metadata"]["labels"]
    replica_labels = objects["StatefulSet", "neopp"]["spec"]["template"]["metadata"]["labels"]
    policy = objects["NetworkPolicy", "neopp-replicas"]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= replica_labels.items()
    assert set(policy["policyTypes"]) == {"Ingress", "Egress"}
    admitted: dict[int, list[dict]] = {}
    for rule in policy["ingress"]:
        assert rule.get("from"), "an ingress rule without 'from' admits every pod"
        for port in rule["ports"]:
            admitted.setdefault(port["port"], []).extend(rule["from"])
    assert set(admitted) == {8000, 8001, 8002}
    for port in (8000, 8001):  # the door and Triton's gRPC: the router's pods only
        assert admitted[port] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "neopp-router"}}}]
        assert admitted[port][0]["podSelector"]["matchLabels"].items() <= router_labels.items()
    assert all(set(source) == {"namespaceSelector"} for source in admitted[8002])  # Prometheus's namespace
    assert all(set(rule) == {"ports"} and {p["port"] for p in rule["ports"]} == {53} for rule in policy["egress"])
    router = objects["NetworkPolicy", "neopp-router"]["spec"]
    exporter = [rule for rule in router["ingress"] if any(p["port"] == STATS_PORT for p in rule["ports"])]
    assert len(exporter) == 1 and all(set(source) == {"namespaceSelector"} for source in exporter[0]["from"])


def test_the_router_bounds_grpc_messages_and_keeps_its_stats_page_private():
    config = render_kubernetes()
    assert f"be2dec(:,4) -m int gt {MAX_GRPC_MESSAGE} }}" in config and MAX_GRPC_MESSAGE == 256 * 2**20
    binds = re.findall(r"^frontend (\S+)\n    bind (\S+)", config, re.MULTILINE)
    assert dict(binds) == {"metrics": f":{STATS_PORT}", "stats_page": STATS_PAGE, "grpc": ":8001", "http": ":8000"}
    assert STATS_PAGE.startswith("127.0.0.1:")
    stats = config[config.index("frontend metrics"):config.index("frontend stats_page")]
    assert "prometheus-exporter if { path /metrics }" in stats and "deny deny_status 404" in stats
    objects = render("cpu")
    router = pod_of(objects, "Deployment", "neopp-router")
    ports = {p["containerPort"] for c in router["containers"] for p in c["ports"]}
    assert ports == {8000, 8001, STATS_PORT}
    assert {p["port"] for p in objects["Service", "neopp"]["spec"]["ports"]} == {8000, 8001}
