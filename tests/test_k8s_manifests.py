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

from deploy.router import MAX_REPLICAS, NAMESPACE, render_kubernetes
from neopp.serving.contract import generation_models

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
                                             "PersistentVolumeClaim", "PodDisruptionBudget", "HorizontalPodAutoscaler"}
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
