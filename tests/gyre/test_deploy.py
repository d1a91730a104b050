"""`gyre deploy`: prepare writes a run's settings once (a prepared run is kept, so an orchestrator's restart
resumes it), a bad config stops it naming the setting, and serve runs a process of the prepared run with its
container's environment over the run's settings."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from gyre.deploy import RUN_ENV, app, process_environment, read_env

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "deploy" / "compose" / "run.yaml"


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("GYRE_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("GYRE_RUN_ID", "r1")
    monkeypatch.delenv("GYRE_DEPLOY_SET", raising=False)
    return tmp_path / "runs" / "r1"


def test_prepare_writes_the_runs_settings_once_and_keeps_them(state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GYRE_DEPLOY_SET", "scheduling.steps=7;scheduling.group_size=2")
    result = CliRunner().invoke(app, ["prepare", "--config", str(CONFIG)])
    assert result.exit_code == 0, result.output
    settings = read_env(state / RUN_ENV)
    assert settings["GYRE_SCHEDULER_TOTAL_STEPS"] == "7" and settings["GYRE_GROUP_SIZE"] == "2"
    assert Path(settings["GYRE_MODEL_DIR"]).is_dir() and settings["GYRE_ROLLOUT_TOKEN_SECRET"]
    assert oct((state / RUN_ENV).stat().st_mode & 0o777) == "0o600"  # it holds the token secret
    # A second prepare (the job run again by `up`, a changed override or not) keeps the run as it was.
    monkeypatch.setenv("GYRE_DEPLOY_SET", "scheduling.steps=9")
    again = CliRunner().invoke(app, ["prepare", "--config", str(CONFIG)])
    assert again.exit_code == 0 and "is prepared" in again.output
    assert read_env(state / RUN_ENV) == settings


def test_a_bad_config_stops_prepare_with_a_line_naming_the_setting_and_writes_nothing(state: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("scheduling:\n  mode: sideways\n")
    result = CliRunner().invoke(app, ["prepare", "--config", str(bad)])
    assert result.exit_code == 2
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "scheduling.mode" in errors[0] and "sideways" in errors[0]
    assert not (state / RUN_ENV).exists()


def test_serve_refuses_an_unknown_process_and_a_run_never_prepared(state: Path) -> None:
    unknown = CliRunner().invoke(app, ["serve", "trainr"])
    assert unknown.exit_code == 2 and "unknown process 'trainr'" in unknown.output
    waited = CliRunner().invoke(app, ["serve", "relay", "--wait-s", "0.5"])
    assert waited.exit_code == 2 and "has `gyre deploy prepare` run?" in waited.output.replace("\n", " ")


def test_a_process_gets_its_containers_settings_over_the_runs() -> None:
    run = {"GYRE_GROUP_SIZE": "4", "GYRE_HEALTH_HOST": "127.0.0.1", "GYRE_ROLLOUT_PORT": "8080"}
    container = {"GYRE_HEALTH_HOST": "0.0.0.0", "GYRE_NATS_URL": "nats://nats:4222"}
    own = {"GYRE_ROLLOUT_PORT": "8081"}
    assert process_environment(run, container, own) == {
        "GYRE_GROUP_SIZE": "4", "GYRE_HEALTH_HOST": "0.0.0.0", "GYRE_NATS_URL": "nats://nats:4222",
        "GYRE_ROLLOUT_PORT": "8081"}
