"""A prepared run through the NATS Object Store (gyre/deploy_share.py): what `prepare` stores a node without the
run's folder fetches whole, with the run folder's paths made its own; a node waits for a run not stored yet and
gives up at its deadline; a bad share mode is named in one line."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from gyre.deploy_share import ShareError, fetch_run, publish_run, same_run, share_mode, stored_settings
from shared.bus import Bus
from shared.settings import Settings
from tests.conftest import Infra, drop_bus, unique


@pytest.fixture
async def settings(infra: Infra):  # type: ignore[no-untyped-def]
    s = Settings(nats_url=infra.nats_url, subject_prefix=unique("t"), run_id=unique("run-"))
    yield s
    bus = await Bus.connect(s.nats_url, prefix=s.subject_prefix)
    await drop_bus(bus)


def prepared(here: Path) -> str:
    (here / "model").mkdir(parents=True)
    (here / "model" / "config.json").write_text('{"model_type": "qwen3"}')
    (here / "model" / "model.safetensors").write_bytes(bytes(range(256)) * 4096)
    (here / "sft" / "nested").mkdir(parents=True)
    (here / "sft" / "nested" / "tokenizer.json").write_text("{}")
    (here / "config.yaml").write_text("seed: 0\n")
    (here / "executions").mkdir()
    (here / "executions" / "not-shared.txt").write_text("a node's own")
    return (f"GYRE_MODEL_DIR={here}/sft\nGYRE_HARNESS_WORK_DIR={here}/executions\nGYRE_TASKS_DIR=/opt/tasks\n"
            f"GYRE_ROLLOUT_TOKEN_SECRET=s3cret\nGYRE_SIBLING={here}-other/x\n")


async def test_a_stored_run_fetches_whole_into_another_nodes_folder(settings: Settings, tmp_path: Path) -> None:
    here, there = tmp_path / "a" / "runs" / "r", tmp_path / "b" / "runs" / "r"
    run_env = prepared(here)
    assert await stored_settings(settings) is None
    stored = await publish_run(settings, here, run_env)
    assert stored > 256 * 4096
    stored_env = await stored_settings(settings)
    assert stored_env is not None and same_run(stored_env, here, run_env)
    assert not same_run(stored_env, here, run_env.replace("s3cret", "another"))  # prepared again, otherwise

    there.mkdir(parents=True)
    assert await fetch_run(settings, there, "run.env", time.monotonic() + 30)
    assert (there / "run.env").read_text() == (
        f"GYRE_MODEL_DIR={there}/sft\nGYRE_HARNESS_WORK_DIR={there}/executions\nGYRE_TASKS_DIR=/opt/tasks\n"
        f"GYRE_ROLLOUT_TOKEN_SECRET=s3cret\nGYRE_SIBLING={here}-other/x\n")  # a sibling folder is not the run's
    assert (there / "run.env").stat().st_mode & 0o077 == 0  # it holds the token secret
    assert (there / "model" / "model.safetensors").read_bytes() == bytes(range(256)) * 4096
    assert (there / "sft" / "nested" / "tokenizer.json").read_text() == "{}"
    assert (there / "config.yaml").read_text() == "seed: 0\n"
    assert not (there / "executions").exists()  # a node's own work is not shared
    assert not list(there.rglob("*.part"))
    # Another process of the node finds the run there and fetches nothing again.
    (there / "model" / "config.json").write_text("kept")
    assert await fetch_run(settings, there, "run.env", time.monotonic() + 30)
    assert (there / "model" / "config.json").read_text() == "kept"


async def test_a_node_waits_for_a_run_stored_later_and_gives_up_at_its_deadline(settings: Settings,
                                                                                tmp_path: Path) -> None:
    there = tmp_path / "b"
    there.mkdir()
    assert not await fetch_run(settings, there, "run.env", time.monotonic() + 1.5)
    assert not (there / "run.env").exists()
    waiting = asyncio.ensure_future(fetch_run(settings, there, "run.env", time.monotonic() + 60))
    await asyncio.sleep(1.5)
    assert not waiting.done()
    await publish_run(settings, tmp_path / "a", prepared(tmp_path / "a"))
    assert await waiting
    assert (there / "model" / "config.json").is_file()


def test_a_bad_share_mode_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GYRE_DEPLOY_SHARE", "nfs")
    with pytest.raises(ShareError, match="GYRE_DEPLOY_SHARE='nfs': expected folder"):
        share_mode()
    monkeypatch.setenv("GYRE_DEPLOY_SHARE", "object")
    assert share_mode() == "object"
