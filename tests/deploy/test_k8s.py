"""deploy/k8s: every manifest validates against the Kubernetes schemas (offline, strict: an unknown field is an
error), the kustomization holds them all, every process of a run has its workload over the prepared run, every
name a pod refers to is defined here or is one of the two documented outside parts (the CloudNativePG
cluster's secret and the NATS chart's service), and docs/deploy.md names each file."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gyre.processes import service_processes

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
VERSION = "1.33.0"
OUTSIDE = {"postgres.yaml", "nats-values.yaml"}  # applied with their operator / chart, not by the kustomization


def manifests() -> list[tuple[str, dict[str, Any]]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return [(name, doc) for name in kustomization["resources"]
            for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]


def pod_specs() -> dict[str, dict[str, Any]]:
    specs = {}
    for _, doc in manifests():
        if doc["kind"] in ("Deployment", "DaemonSet", "Job"):
            specs[doc["metadata"]["name"]] = doc["spec"]["template"]["spec"]
    return specs


def test_the_kustomization_holds_every_manifest_of_the_folder() -> None:
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - OUTSIDE - {"kustomization.yaml"}


@pytest.mark.parametrize("name", sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml"
                                         and p.name not in OUTSIDE))
def test_each_manifest_validates_against_the_kubernetes_schemas(name: str) -> None:
    for doc in yaml.safe_load_all((K8S / name).read_text()):
        if doc:
            kubernetes_validate.validate(doc, VERSION, strict=True)


def test_validation_refuses_an_unknown_field_and_a_wrong_type() -> None:
    deployment = next(doc for _, doc in manifests() if doc["kind"] == "Deployment")
    unknown = copy.deepcopy(deployment)
    unknown["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Never"
    wrong = copy.deepcopy(deployment)
    wrong["spec"]["replicas"] = "one"
    for doc in (unknown, wrong):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(doc, VERSION, strict=True)


def test_every_process_of_a_run_has_its_workload_and_only_cells_hold_accelerators() -> None:
    specs = pod_specs()
    for proc in service_processes(sys.executable):
        spec = specs[f"gyre-{proc.name}"]
        assert spec["containers"][0]["args"] == ["deploy", "serve", proc.name], proc.name
        assert spec["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/healthz", proc.name
    assert specs["gyre-prepare"]["containers"][0]["args"][:2] == ["deploy", "prepare"]
    assert specs["gyre-report"]["containers"][0]["args"] == ["deploy", "report"]
    holding = {name for name, spec in specs.items()
               if "nvidia.com/gpu" in spec["containers"][0].get("resources", {}).get("limits", {})}
    assert holding == {"gyre-cells"}
    kinds = {doc["metadata"]["name"]: doc["kind"] for _, doc in manifests()}
    assert kinds["gyre-cells"] == "DaemonSet"  # a cell agent per accelerator node
    cells_env = {e["name"]: e for e in specs["gyre-cells"]["containers"][0]["env"]}
    assert cells_env["GYRE_CELL_NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # The weights stream: settings a rank reads, rank 0 reached at its pod's own address.
    from services.trainer.options import RankOptions

    rank_settings = {f"GYRE_TRAINER_{field}".upper() for field in RankOptions.model_fields}
    assert {"GYRE_TRAINER_WEIGHTS_STREAM", "GYRE_TRAINER_WEIGHTS_STREAM_HOST"} <= rank_settings & cells_env.keys()
    assert cells_env["GYRE_TRAINER_WEIGHTS_STREAM_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_every_name_a_pod_refers_to_is_defined_here_or_outside_as_documented() -> None:
    defined = {(doc["kind"], doc["metadata"]["name"]) for _, doc in manifests()}
    outside = {("Secret", "gyre-db-app")}  # made by the CloudNativePG cluster of postgres.yaml
    postgres = yaml.safe_load((K8S / "postgres.yaml").read_text())
    assert postgres["kind"] == "Cluster" and postgres["metadata"]["name"] == "gyre-db"
    for name, spec in pod_specs().items():
        for volume in spec.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in defined, name
            if "configMap" in volume:
                assert ("ConfigMap", volume["configMap"]["name"]) in defined, name
        for container in spec["containers"]:
            for source in container.get("envFrom", []):
                assert ("ConfigMap", source["configMapRef"]["name"]) in defined, name
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ("Secret", ref["name"]) in defined | outside, name


def test_the_cluster_addresses_name_services_that_exist() -> None:
    common = next(doc for _, doc in manifests() if doc["metadata"]["name"] == "gyre-common")["data"]
    services = {doc["metadata"]["name"]: doc for _, doc in manifests() if doc["kind"] == "Service"}
    assert common["GYRE_TRAINER_STORE_HOST"] in services
    assert common["GYRE_HARNESS_GATEWAY_URL"].split("//")[1].split(":")[0] in services
    nats = yaml.safe_load((K8S / "nats-values.yaml").read_text())
    assert common["GYRE_NATS_URL"] == "nats://nats:4222"  # the chart's service, released as `nats`
    assert nats["config"]["cluster"]["replicas"] == 3 and nats["config"]["jetstream"]["enabled"]
    assert common["GYRE_STREAM_REPLICAS"] == "3"


def test_the_deploy_guide_names_every_file() -> None:
    guide = (REPO / "docs" / "deploy.md").read_text()
    for path in K8S.glob("*.yaml"):
        assert f"deploy/k8s/{path.name}" in guide or f"`{path.name}`" in guide, path.name
