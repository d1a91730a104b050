"""The `gyre` command as an operator uses it: up, status, events export/tail, migrate, down."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import Infra, unique
from tests.shared.helpers import assigned


def gyre(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gyre.cli", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GYRE_")}
    return {**env, **extra}


def test_up_status_down_with_embedded_servers():
    state = Path(tempfile.mkdtemp(prefix="gyre-cli-"))
    env = clean_env(GYRE_STATE_DIR=str(state))
    try:
        up = gyre("up", env=env)
        assert up.returncode == 0, up.stderr
        assert "GYRE_NATS_URL=nats://127.0.0.1:" in up.stdout
        assert "GYRE_DATABASE_URL=postgresql://" in up.stdout
        status = json.loads(gyre("status", env=env).stdout)
        assert status["running"] and status["nats"]["embedded"] and status["postgres"]["up"]
        again = gyre("up", env=env)  # idempotent: the same servers
        assert again.stdout == up.stdout
        assert (state / "env").read_text().splitlines()[0] in up.stdout
    finally:
        down = gyre("down", env=env)
    assert "nats" in down.stderr and "postgres" in down.stderr
    assert json.loads(gyre("status", env=env).stdout) == {"running": False}


async def test_events_export_and_tail_read_the_log(store, infra: Infra, tmp_path: Path):
    events = [assigned(f"cell-x{i}", 1, run_id="cli-run") for i in range(3)] + [assigned("cell-other", 1)]
    await store.append(events)
    env = clean_env(
        GYRE_DATABASE_URL=infra.database_url, GYRE_NATS_URL=infra.nats_url, GYRE_DB_SCHEMA=store.schema
    )
    out = tmp_path / "log.jsonl"
    result = gyre("events", "export", str(out), "--run", "cli-run", env=env)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["event_id"] for line in lines] == [str(e.event_id) for e in events[:3]]
    tail = gyre("events", "tail", "--no-follow", "--stream", "cell-other", env=env)
    assert [json.loads(line)["stream_id"] for line in tail.stdout.splitlines()] == ["cell-other"]


async def test_a_run_exported_with_its_blobs_is_a_log_file_replay_and_the_dashboard_read(
        store, infra: Infra, tmp_path: Path):
    from services.trajectory.replay import import_text, replay
    from tests.gyre.test_dashboard import golden, load_into

    log = golden("compaction")
    await load_into(store, log)
    await store.append([assigned("cell-other", 1)])  # another run's event stays out
    env = clean_env(
        GYRE_DATABASE_URL=infra.database_url, GYRE_NATS_URL=infra.nats_url, GYRE_DB_SCHEMA=store.schema
    )
    out = tmp_path / "run.jsonl"
    result = gyre("events", "export", str(out), "--run", log.events[0].run_id, "--with-blobs", env=env)
    assert result.returncode == 0, result.stderr
    back = import_text(out.read_text())
    assert [e.event_id for e in back.events] == [e.event_id for e in log.events] and back.blobs == log.blobs
    assert [x.digest for x in replay(back.events, back.get_blob).executions] == \
        [x.digest for x in replay(log.events, log.get_blob).executions]


def test_configured_urls_win_over_running_embedded_servers_and_get_the_schema(infra: Infra):
    """`gyre up` with URLs uses them (and migrates GYRE_DB_SCHEMA there, as the services read it) even while
    this folder runs embedded servers, which `gyre down` still stops."""
    import psycopg

    state = Path(tempfile.mkdtemp(prefix="gyre-cli-"))
    embedded = clean_env(GYRE_STATE_DIR=str(state))
    schema = unique("up_")
    configured = clean_env(GYRE_STATE_DIR=str(state), GYRE_NATS_URL=infra.nats_url,
                           GYRE_DATABASE_URL=infra.database_url, GYRE_DB_SCHEMA=schema)
    try:
        assert gyre("up", env=embedded).returncode == 0
        up = gyre("up", env=configured)
        assert up.returncode == 0, up.stderr
        assert f"GYRE_NATS_URL={infra.nats_url}" in up.stdout and f"GYRE_DATABASE_URL={infra.database_url}" in up.stdout
        with psycopg.connect(infra.database_url) as conn:
            tables = conn.execute("SELECT count(*) FROM information_schema.tables WHERE table_schema = %s",
                                  (schema,)).fetchone()
        assert tables is not None and tables[0] > 0
    finally:
        down = gyre("down", env=embedded)
        with psycopg.connect(infra.database_url, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    assert "nats" in down.stderr and "postgres" in down.stderr


def test_a_failed_up_leaves_nothing_that_down_cannot_stop():
    state = Path(tempfile.mkdtemp(prefix="gyre-cli-"))
    env = clean_env(GYRE_STATE_DIR=str(state), GYRE_DATABASE_URL="postgresql://postgres@127.0.0.1:1/none")
    try:
        up = gyre("up", env=env)
        assert up.returncode == 2 and "could not migrate" in up.stdout + up.stderr
        assert "Traceback" not in up.stdout + up.stderr
    finally:
        down = gyre("down", env=env)
    assert "nats" in down.stderr  # the embedded NATS it had started


def test_commands_without_servers_say_what_to_do():
    env = clean_env(GYRE_STATE_DIR=tempfile.mkdtemp(prefix="gyre-none-"))
    result = gyre("events", "tail", "--no-follow", env=env)
    assert result.returncode != 0
    assert "gyre up" in result.stderr


def test_migrate_is_idempotent(infra: Infra):
    import psycopg

    schema = unique("m_")
    env = clean_env(GYRE_DATABASE_URL=infra.database_url, GYRE_NATS_URL=infra.nats_url, GYRE_DB_SCHEMA=schema)
    try:
        for _ in range(2):
            result = gyre("migrate", env=env)
            assert result.returncode == 0, result.stderr
    finally:
        with psycopg.connect(infra.database_url, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.mark.parametrize("bad", [["model", "init", "/tmp/x", "--size", "huge"], ["serve", "nonsense"]])
def test_bad_arguments_are_refused_with_a_message(bad):
    result = gyre(*bad, env=clean_env())
    assert result.returncode == 2
    assert "huge" in result.stderr or "nonsense" in result.stderr


def test_the_top_level_help_lists_every_group_without_importing_the_services():
    """`gyre --help` names each lazy group with its help text and imports none of them (they bring torch and
    vLLM); a group's own help mounts the real group."""
    from gyre.cli import LAZY_GROUPS

    probe = ("import sys, runpy; sys.argv = ['gyre', '--help']\n"
             "try:\n    runpy.run_module('gyre.cli', run_name='__main__')\nexcept SystemExit:\n    pass\n"
             "print('IMPORTED', sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'services')))")
    out = subprocess.run([sys.executable, "-c", probe], env={**clean_env(), "COLUMNS": "200"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for name, (_, _, help_text) in LAZY_GROUPS.items():
        assert f" {name} " in out.stdout and help_text in out.stdout
    assert "IMPORTED []" in out.stdout
    replay = gyre("replay", "--help", env={**clean_env(), "COLUMNS": "200"})
    assert replay.returncode == 0 and "--verify" in replay.stdout


@pytest.mark.parametrize("group", ["sim", "replay", "train", "harness", "rollout", "scheduler", "run"])
def test_a_groups_help_imports_no_engine_sdk_or_trainer(group: str) -> None:
    """`gyre <group> --help` mounts the group and answers without torch, vLLM or the agent's SDK: their imports
    (seconds) happen in the commands that use them (bench/cli_help.py times every --help)."""
    from gyre.cli import LAZY_GROUPS

    assert group in LAZY_GROUPS
    probe = (f"import sys, runpy; sys.argv = ['gyre', {group!r}, '--help']\n"
             "try:\n    runpy.run_module('gyre.cli', run_name='__main__')\nexcept SystemExit:\n    pass\n"
             "print('IMPORTED', sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'vllm', 'anthropic', "
             "'transformers'}))")
    out = subprocess.run([sys.executable, "-c", probe], env={**clean_env(), "COLUMNS": "200"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "IMPORTED []" in out.stdout, out.stdout[-500:]
