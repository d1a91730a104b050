"""compose.yaml and its override files: valid against the Compose specification, and what Compose renders from
them runs every process of a run (the same entry points `gyre run` starts), one-shot jobs before them, nothing
but the cells training, health where the orchestrator reaches it. tests/deploy/test_compose_up.py brings it up."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gyre.processes import service_processes

REPO = Path(__file__).resolve().parents[2]
COMPOSE = shutil.which("docker-compose") or str(Path(sys.executable).parent / "docker-compose")
PROCESSES = [p.name for p in service_processes(sys.executable)]


def env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def rendered(*files: str) -> dict:
    """The project as Compose itself merges and interpolates it (`config`: no engine needed)."""
    argv = [COMPOSE, *(a for f in files for a in ("-f", f)), "config", "--format", "yaml"]
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


@pytest.mark.parametrize("name", ["compose.yaml", "compose.local.yaml", "compose.gpu.yaml"])
def test_each_compose_file_validates_against_the_compose_specification(name: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(REPO / name)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_process_of_a_run_is_a_service_over_the_prepared_run() -> None:
    services = rendered("compose.yaml")["services"]
    for name in PROCESSES:
        service = services[name]
        assert service["command"] == ["deploy", "serve", name], name
        assert service["depends_on"]["prepare"]["condition"] == "service_completed_successfully", name
        assert service["healthcheck"]["test"], name
        assert service["environment"]["GYRE_HEALTH_HOST"] == "0.0.0.0", name
        assert any(v["target"] == "/var/lib/gyre" for v in service["volumes"]), name
    # One-shot jobs: the schema, then the run prepared from its config; the report when the run is done.
    assert services["migrate"]["command"] == ["migrate"] and services["migrate"]["restart"] == "no"
    assert services["prepare"]["command"][:2] == ["deploy", "prepare"]
    assert services["prepare"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert services["report"]["command"] == ["deploy", "report"] and services["report"]["restart"] == "no"
    # Nothing but the cells trains: the trainer service is the coordinator, and the ranks reach its rendezvous.
    assert services["trainer"]["environment"]["GYRE_TRAINER_STORE_HOST"] == "trainer"
    assert not any("rank" in " ".join(s.get("command") or []) for s in services.values())
    # The harness's sandboxes: bubblewrap with the two capabilities it needs, and not privileged.
    harness = services["harness"]
    assert set(harness["cap_add"]) == {"SYS_ADMIN", "NET_ADMIN"} and not harness.get("privileged")
    assert harness["environment"]["GYRE_HARNESS_BACKEND"] == "bwrap"
    # A recreated cells container keeps its cells' ids.
    assert services["cells"]["environment"]["GYRE_CELL_NODE_ID"]


def test_the_local_override_builds_every_image_here() -> None:
    services = rendered("compose.yaml", "compose.local.yaml")["services"]
    assert services["postgres"]["image"] == "gyre-postgres:local" and services["postgres"]["build"]
    assert services["nats"]["entrypoint"] == ["nats-server"] and services["nats"]["image"] == "gyre:latest"
    for name in [*PROCESSES, "migrate", "prepare", "report"]:
        assert services[name]["build"]["args"]["BASE"] == "gyre-base:bookworm", name
    # No image the project does not build itself.
    assert {s["image"] for s in services.values()} == {"gyre:latest", "gyre-postgres:local"}


def test_the_gpu_override_reserves_the_gpus_for_the_cells_and_builds_the_gpu_image() -> None:
    services = rendered("compose.yaml", "compose.gpu.yaml")["services"]
    devices = services["cells"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
    assert all(services[n]["build"]["args"]["ENGINE"] == "gpu" for n in PROCESSES)
    assert not any("deploy" in services[n] for n in PROCESSES if n != "cells")


def test_the_env_files_name_settings_the_services_read() -> None:
    from gyre.config import VARIABLES
    from gyre.deploy_share import DeployOptions
    from services.harness.service import HarnessSettings
    from services.rollout.service import RolloutSettings
    from services.scheduler.cell_settings import CellSettings
    from services.trainer.options import RankOptions, TrainerOptions
    from shared.settings import Settings

    known = {name for names in VARIABLES.values() for name in names}
    for model in (Settings, CellSettings, TrainerOptions, RankOptions, HarnessSettings, RolloutSettings,
                  DeployOptions):
        prefix = model.model_config.get("env_prefix", "")
        known |= {f"{prefix}{field}".upper() for field in model.model_fields}
    for path in sorted((REPO / "deploy" / "env").glob("*.env")):
        unknown = set(env_file(path)) - known
        assert not unknown, f"{path.name}: {sorted(unknown)}"
