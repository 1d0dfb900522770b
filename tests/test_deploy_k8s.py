"""deploy/k8s/ checked by validators, not by eye. Built-in kinds are validated against the
Kubernetes 1.33 schemas shipped by the PyPI package kubernetes-validate, in its strict mode
(an unknown field is an error, as with kubectl's strict field validation); the custom
resources (KEDA's ScaledObject, KubeRay's RayService) against their upstream CRDs' schemas,
vendored in tests/k8s_crds (SOURCE.md there), made strict the same way; the RayService's
serveConfigV2 against Ray Serve's own config schema. Then what no schema knows: the manifests
agree with each other and with the server (probe paths are routes, environment names are
settings with valid values, the scaled metric is one /metrics exports, selectors select the
pods, the grace period outlasts the drain). Nothing is started.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import msgspec
import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from app.main import openapi_document
from app.settings import Settings
from engine.metrics import EngineGauges, ServingMetrics
from tests.conftest import ROOT
from tests.k8s_crds.vendor_crds import schema_path

K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.33"
CUSTOM_KINDS = {("keda.sh/v1alpha1", "ScaledObject"), ("ray.io/v1", "RayService")}
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
# Environment variables the server's container may set that are not settings: PyTorch's.
NOT_SETTINGS = {"OMP_NUM_THREADS"}


def load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def objects() -> dict[str, dict[str, Any]]:
    """Every object of the manifests, by kind (each kind appears once)."""
    found = [doc for path in MANIFESTS for doc in load(path)]
    by_kind = {doc["kind"]: doc for doc in found}
    assert len(by_kind) == len(found), "one object per kind"
    return by_kind


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with every object that lists its properties closed to others, unless it
    preserves unknown fields (as the API server's strict field validation treats them)."""
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {name: strict(sub) for name, sub in out["properties"].items()}
        preserves = out.get("x-kubernetes-preserve-unknown-fields", False)
        if "additionalProperties" not in out and not preserves:
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties"):
        if isinstance(out.get(key), dict):
            out[key] = strict(out[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in out:
            out[key] = [strict(sub) for sub in out[key]]
    return out


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifests_validate_strictly(path: Path) -> None:
    for doc in load(path):
        if (doc["apiVersion"], doc["kind"]) in CUSTOM_KINDS:
            crd = json.loads(schema_path(doc["kind"], doc["apiVersion"]).read_text())
            jsonschema.Draft202012Validator(strict(crd)).validate(doc)
            # A CRD's schema leaves metadata to the API server: check it as any object's.
            meta = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]}
            kubernetes_validate.validate(meta, KUBERNETES_VERSION, strict=True)
        else:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_strict_validation_rejects_an_unknown_field() -> None:
    """The validators above do refuse what the API server would."""
    deployment = objects()["Deployment"]
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(jsonschema.ValidationError, match="livenesProbe"):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    rayservice = objects()["RayService"]
    rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["replica"] = 1
    crd = json.loads(schema_path("RayService", "ray.io/v1").read_text())
    with pytest.raises(jsonschema.ValidationError, match="replica"):
        jsonschema.Draft202012Validator(strict(crd)).validate(rayservice)


def test_kustomization_applies_every_manifest_but_the_rayservice() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == [
        p.name for p in MANIFESTS if p.name != "rayservice.yaml"
    ]
    assert kustomization["namespace"] == objects()["Namespace"]["metadata"]["name"]
    (image,) = kustomization["images"]
    assert image["name"] == server_container()["image"]  # the name kustomize rewrites


def server_container() -> dict[str, Any]:
    (container,) = objects()["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container


def test_probes_ask_the_server_s_routes() -> None:
    container = server_container()
    paths = openapi_document()["paths"]
    assert container["startupProbe"]["httpGet"]["path"] == "/live"
    assert container["livenessProbe"]["httpGet"]["path"] == "/live"  # 200 while draining
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"  # 503 while draining
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["path"] in paths
        assert container[probe]["httpGet"]["port"] == "http"
    (port,) = container["ports"]
    assert port["name"] == "http"
    assert int(objects()["ConfigMap"]["data"]["PORT"]) == port["containerPort"]


def test_environment_names_are_settings_with_valid_values() -> None:
    config, secret = objects()["ConfigMap"], objects()["Secret"]
    container = server_container()
    assert [ref["configMapRef"]["name"] for ref in container["envFrom"]] == [
        config["metadata"]["name"]
    ]
    settings = set(Settings.__struct_fields__)
    assert set(config["data"]) <= settings
    assert set(secret["stringData"]) <= settings
    for variable in container["env"]:
        assert variable["name"] in settings | NOT_SETTINGS, variable["name"]
        if ref := variable.get("valueFrom", {}).get("secretKeyRef"):
            assert ref["name"] == secret["metadata"]["name"]
            assert ref["key"] in secret["stringData"]
    # The values convert as the server converts them (app.settings.load_settings).
    msgspec.convert(config["data"] | secret["stringData"], Settings, strict=False)


def test_the_grace_period_outlasts_the_drain() -> None:
    """The kubelet SIGKILLs terminationGracePeriodSeconds after deletion starts: preStop,
    then SHUTDOWN_GRACE_S of drain, then up to 10 s more (the engine waits 5 s for the
    requests it cut to end, and 5 s for its thread)."""
    pod = objects()["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    grace_s = float(objects()["ConfigMap"]["data"]["SHUTDOWN_GRACE_S"])
    assert pod["terminationGracePeriodSeconds"] >= float(command[1]) + grace_s + 10


def test_selectors_select_the_pods() -> None:
    deployment = objects()["Deployment"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    selectors = [
        deployment["spec"]["selector"]["matchLabels"],
        objects()["Service"]["spec"]["selector"],
        objects()["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"],
    ]
    for selector in selectors:
        assert selector.items() <= labels.items(), selector
    (service_port,) = objects()["Service"]["spec"]["ports"]
    assert service_port["targetPort"] == server_container()["ports"][0]["name"]


def test_the_scaler_reads_a_metric_the_server_exports() -> None:
    scaled = objects()["ScaledObject"]
    assert scaled["spec"]["scaleTargetRef"]["name"] == objects()["Deployment"]["metadata"]["name"]
    (trigger,) = scaled["spec"]["triggers"]
    query = trigger["metadata"]["query"]
    metric = re.fullmatch(r"sum\(([a-z_:]+)\{namespace=\"([a-z-]+)\"\}\)", query)
    assert metric, query
    assert metric[2] == objects()["Namespace"]["metadata"]["name"]
    # What /metrics writes (app/routes_ops.py), with 3 requests waiting.
    metrics = ServingMetrics("gemma-3-270m")
    metrics.update_gauges(EngineGauges(0, 3, 0.0, 0, 0, 0, {}))
    text = generate_latest(metrics.registry).decode()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[metric[1]] == 3
    assert float(trigger["metadata"]["threshold"]) > 0


def test_the_rayservice_runs_the_serve_app() -> None:
    import ray
    from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

    rayservice = objects()["RayService"]
    cluster = rayservice["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray.__version__
    config = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(config)
    # Ray's schemas ignore unknown fields; the names must be theirs.
    assert set(config) <= set(ServeDeploySchema.model_fields)
    (application,) = config["applications"]
    assert set(application) <= set(ServeApplicationSchema.model_fields)
    assert application["import_path"] == "deploy.ray_serve:app"
    from deploy.ray_serve import ScaleOutArgs, app  # the builder validates args into this

    assert callable(app)
    args = application["args"]
    assert set(args) <= set(ScaleOutArgs.model_fields)  # the model ignores unknown names
    parsed = ScaleOutArgs.model_validate(args)
    # One replica per worker pod, given the pod's CPUs.
    (workers,) = cluster["workerGroupSpecs"]
    (worker,) = workers["template"]["spec"]["containers"]
    assert workers["replicas"] == workers["minReplicas"] == parsed.replicas
    assert float(worker["resources"]["limits"]["cpu"]) == parsed.num_cpus
