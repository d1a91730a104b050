"""The `gyre harness` commands, driven through typer's runner."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from services.harness.cli import harness_app

from .conftest import TASKS

runner = CliRunner()


def test_check_task_prints_the_task_summary() -> None:
    result = runner.invoke(harness_app, ["check-task", str(TASKS / "repair-git-repo")])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["workdir"] == "/app" and summary["setup"] is True and summary["solution"] is True


def test_check_task_rejects_a_bad_folder_naming_file_and_field(tmp_path: Path) -> None:
    (tmp_path / "task.yaml").write_text("instruction: x\nmax_test_timeout_sec: -1\n")
    result = runner.invoke(harness_app, ["check-task", str(tmp_path)])
    assert result.exit_code == 2
    assert "task.yaml" in result.output and "max_test_timeout_sec" in result.output


def test_run_solution_resolves_and_untouched_does_not(best_backend: str) -> None:
    solved = runner.invoke(harness_app, ["run-solution", str(TASKS / "uppercase-1"), "--backend", best_backend])
    assert solved.exit_code == 0, solved.output
    assert json.loads(solved.output)["score"] == 1.0
    untouched = runner.invoke(harness_app, ["run-solution", str(TASKS / "uppercase-1"), "--backend", best_backend, "--no-solution"])
    assert untouched.exit_code == 1
    assert json.loads(untouched.output)["score"] < 1.0


SECRET = "cli-test-token-secret"


def test_run_derives_the_token_of_the_named_execution_from_the_secret(tmp_path: Path, best_backend: str) -> None:
    """`gyre harness run --execution-id E --token-secret S` calls the model with E's token (as the service
    would), so the gateway records the calls on E's stream: the one the run's check reads."""
    from shared.execution_tokens import derive_execution_token

    from .scripted_server import ScriptedAnthropicServer, shell, submit

    token = derive_execution_token(SECRET.encode(), "execution-cli-1")
    with ScriptedAnthropicServer([shell("printf 'hello world\\n' > /app/hello.txt"), submit()], token=token) as server:
        result = runner.invoke(harness_app, [
            "run", str(TASKS / "create-file-1"), "--base-url", server.base_url, "--model", "tiny",
            "--execution-id", "execution-cli-1", "--token-secret", SECRET, "--backend", best_backend,
            "--state-dir", str(tmp_path / "state"),
        ], env={"GYRE_DATABASE_URL": ""})
    assert result.exit_code == 0, result.output
    outcome = json.loads(result.output.strip().splitlines()[-1])
    assert outcome["execution_id"] == "execution-cli-1" and outcome["grade"]["score"] == 1.0
    assert {h["authorization"] for h in server.headers} == {f"Bearer {token}"}
    # The token alone names its execution: the run is that execution, not a fresh id the gateway never saw.
    with ScriptedAnthropicServer([shell("printf 'hello world\\n' > /app/hello.txt"), submit()], token=token) as server:
        alone = runner.invoke(harness_app, [
            "run", str(TASKS / "create-file-1"), "--base-url", server.base_url, "--model", "tiny", "--token", token,
            "--backend", best_backend, "--state-dir", str(tmp_path / "again"),
        ], env={"GYRE_DATABASE_URL": "", "GYRE_HARNESS_GATEWAY_TOKEN_SECRET": "", "GYRE_ROLLOUT_TOKEN_SECRET": ""})
    assert alone.exit_code == 0, alone.output
    assert json.loads(alone.output.strip().splitlines()[-1])["execution_id"] == "execution-cli-1"


def test_run_refuses_a_token_it_cannot_tie_to_the_execution_whose_calls_it_reads(tmp_path: Path) -> None:
    """With the log to read, a token given without its execution id, or one not derived for the id given, would
    have the check read another execution's calls: refused before anything runs."""
    from shared.execution_tokens import derive_execution_token, execution_named_by

    common = ["run", str(TASKS / "create-file-1"), "--base-url", "http://127.0.0.1:9", "--model", "tiny"]
    alone = runner.invoke(harness_app, [*common, "--token", "gx-some-token"],
                          env={"GYRE_DATABASE_URL": "postgresql://nowhere/db"})
    assert alone.exit_code == 2 and "--execution-id is required" in alone.output
    assert execution_named_by(derive_execution_token(SECRET.encode(), "execution-cli-9")) == "execution-cli-9"
    other = derive_execution_token(SECRET.encode(), "execution-other")
    mismatched = runner.invoke(harness_app, [*common, "--execution-id", "execution-cli-2", "--token", other,
                                             "--token-secret", SECRET])
    assert mismatched.exit_code == 2 and "was not derived for execution 'execution-cli-2'" in mismatched.output
    neither = runner.invoke(harness_app, common, env={"GYRE_HARNESS_GATEWAY_TOKEN_SECRET": "",
                                                      "GYRE_ROLLOUT_TOKEN_SECRET": ""})
    assert neither.exit_code == 2 and "expected --token, or --token-secret" in neither.output


async def test_the_run_reads_the_call_account_of_its_execution_from_the_log(store) -> None:  # type: ignore[no-untyped-def]
    """The check `gyre harness run --database-url` makes at an external agent's exit folds the stream of the
    execution it ran, and no other."""
    import asyncio

    from services.harness.cli import StoredCallAccount
    from shared.events import CallRefused, new_event, stream_id_for
    from shared.runtime import utcnow

    def refused(execution_id: str, status: int) -> object:
        data = CallRefused(execution_id=execution_id, status=status, kind="api_error", reason="engine down",
                           infra=status >= 500)
        return new_event(data, run_id="r", stream_id=stream_id_for("execution", execution_id), version=1,
                         occurred_at=utcnow())

    await store.append([refused("execution-cli-3", 503), refused("execution-cli-4", 400)], expected_version="any")
    database_url = store.dsn()
    account = await asyncio.to_thread(StoredCallAccount(database_url, store.schema, "execution-cli-3").call_account)
    assert account is not None and account.last_infra_refusal == "503 api_error: engine down"
    other = await asyncio.to_thread(StoredCallAccount(database_url, store.schema, "execution-cli-4").call_account)
    assert other is not None and other.last_infra_refusal is None and other.refused == 1
