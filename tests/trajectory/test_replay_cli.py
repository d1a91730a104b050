"""`gyre replay` end to end: golden files, export → from-file round trip, loud failures, and Postgres."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from typer.testing import CliRunner

from services.trajectory.cli import EXIT_BAD_LOG, EXIT_DIVERGED, replay_app
from services.trajectory.replay import import_text
from tests.conftest import Infra

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
runner = CliRunner()


def invoke(*args: str):  # noqa: ANN201
    return runner.invoke(replay_app, list(args))


def test_replay_verifies_every_golden_log() -> None:
    for path in sorted(GOLDEN.glob("*.jsonl")):
        result = invoke("--from-file", str(path), "--verify")
        assert result.exit_code == 0, (path.name, result.output)
        assert "deterministic" in result.output


def test_replay_prints_the_tree_and_statistics() -> None:
    result = invoke("--from-file", str(GOLDEN / "retries.jsonl"), "--execution", "golden-retries")
    assert result.exit_code == 0, result.output
    assert "execution golden-retries" in result.output and "retry 2" in result.output


def test_export_then_replay_from_the_file(tmp_path: Path) -> None:
    out = tmp_path / "step0.jsonl"
    result = invoke("--from-file", str(GOLDEN / "group.jsonl"), "--step", "0", "--export", str(out), "-q")
    assert result.exit_code == 0, result.output
    again = invoke("--from-file", str(out), "--verify", "-q")
    assert again.exit_code == 0 and "matching the live batches" in again.output


def test_corrupted_log_exits_non_zero(tmp_path: Path) -> None:
    lines = (GOLDEN / "compaction.jsonl").read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(line for line in lines if '"call_index":1,' not in line))
    result = invoke("--from-file", str(bad), "--verify")
    assert result.exit_code == EXIT_BAD_LOG and "corrupted log" in result.output


def test_divergence_prints_the_first_differing_position(tmp_path: Path) -> None:
    text = (GOLDEN / "group.jsonl").read_text()
    tampered = tmp_path / "tampered.jsonl"
    tampered.write_text(text.replace('"reward":0.5', '"reward":0.75', 1))
    result = invoke("--from-file", str(tampered), "--verify", "-q")
    assert result.exit_code == EXIT_DIVERGED
    assert "DIVERGED" in result.output and "entry 0" in result.output


def test_unknown_selection_is_an_error() -> None:
    result = invoke("--from-file", str(GOLDEN / "drift.jsonl"), "--execution", "nope")
    assert result.exit_code == EXIT_BAD_LOG and "nothing in the log matches" in result.output


async def test_replay_reads_postgres_and_never_writes(store, infra: Infra, monkeypatch, tmp_path: Path) -> None:
    log = import_text((GOLDEN / "group.jsonl").read_text())
    for data in log.blobs.values():
        await store.blobs.put(data)
    await store.append(log.events)
    head = await store.head_position()
    monkeypatch.setenv("GYRE_DATABASE_URL", infra.database_url)
    monkeypatch.setenv("GYRE_NATS_URL", infra.nats_url)
    monkeypatch.setenv("GYRE_DB_SCHEMA", store.schema or "")
    out = tmp_path / "run.jsonl"
    result = await asyncio.to_thread(invoke, "--run", "golden-run", "--verify", "--export", str(out), "-q")
    assert result.exit_code == 0, result.output
    assert "matching the live batches" in result.output
    assert await store.head_position() == head  # nothing appended
    exported = import_text(out.read_text())
    assert sorted(str(e.event_id) for e in exported.events) == sorted(str(e.event_id) for e in log.events)
    assert json.loads(out.read_text().splitlines()[0])["format"] == "gyre-execution-log"


async def test_replay_of_a_corrupted_blob_in_postgres_fails_loudly(store, infra: Infra, monkeypatch) -> None:
    import sqlalchemy as sa

    log = import_text((GOLDEN / "drift.jsonl").read_text())
    for data in log.blobs.values():
        await store.blobs.put(data)
    await store.append(log.events)
    victim = next(iter(log.blobs))
    async with store.engine.begin() as conn:
        await conn.execute(sa.text("UPDATE blobs SET data = :d WHERE digest = :g"), {"d": b"garbage", "g": victim})
    monkeypatch.setenv("GYRE_DATABASE_URL", infra.database_url)
    monkeypatch.setenv("GYRE_NATS_URL", infra.nats_url)
    monkeypatch.setenv("GYRE_DB_SCHEMA", store.schema or "")
    result = await asyncio.to_thread(invoke, "--execution", "golden-drift", "--verify")
    assert result.exit_code == EXIT_BAD_LOG and "corrupted log" in result.output


def _run_with_a_batch(run_id: str, rewards: list[float]) -> tuple[list, dict[str, bytes]]:
    """One run's step 0: a query of len(rewards) executions, scored, and its live batch."""
    from services.trajectory.service import batch_ready_data
    from services.trajectory.state import BatchParams, RunLog, assemble_step_batch
    from services.trajectory.synthetic import EPOCH, SyntheticExecution, stable_uuid
    from shared.batch import BATCH_MEDIA_TYPE
    from shared.events import BlobRef, QueryDispatched, new_event
    from shared.tokens import digest_of

    query = f"{run_id}-step0-q0"
    events = [new_event(QueryDispatched(query_id=query, task_id="t", group_size=len(rewards),
                                        seeds=list(range(len(rewards))), step=0, policy_version=0),
                        run_id=run_id, stream_id=f"query-{query}", version=1, occurred_at=EPOCH,
                        event_id=stable_uuid(run_id, query))]
    blobs: dict[str, bytes] = {}
    for i, reward in enumerate(rewards):
        log = SyntheticExecution(f"{query}-s{i}", query_id=query, run_id=run_id, group_size=len(rewards), sample_index=i)
        log.start()
        log.call([1, 2, 3], [4 + i, 5])
        log.finish()
        log.score(reward)
        events += log.events
        blobs.update(log.blobs)
    fold = RunLog()
    fold.apply_all(events)
    batch = assemble_step_batch(fold, 0, lambda ref: blobs[ref.digest], BatchParams(256, 4, 1e-6, False, 1))
    data = batch.encode()
    ref = BlobRef(digest=digest_of(data), size=len(data), media_type=BATCH_MEDIA_TYPE)
    blobs[ref.digest] = data
    events.append(new_event(batch_ready_data(0, batch, ref), run_id=run_id, stream_id=f"batch-{run_id}-0",
                            version=1, occurred_at=EPOCH, event_id=stable_uuid(run_id, "batch")))
    return events, blobs


def test_a_log_of_several_runs_is_verified_run_by_run() -> None:
    """Steps are numbered per run: `--step 0` (or the whole log) over two runs checks each run's step 0 against
    its own live batch, not a mix of both against the first."""
    from services.trajectory.replay import Selection, verify

    events_a, blobs_a = _run_with_a_batch("run-a", [1.0, 0.0, 0.5])
    events_b, blobs_b = _run_with_a_batch("run-b", [0.0, 0.0, 1.0, 1.0])
    blobs = {**blobs_a, **blobs_b}
    for selection in (Selection(step=0), Selection()):
        report = verify(events_a + events_b, lambda ref: blobs[ref.digest], selection)
        assert [(b.step, b.live_digest == b.rebuilt_digest) for b in report.batches] == [(0, True), (0, True)]
        assert len(report.executions) == 7
