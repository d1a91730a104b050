"""Golden execution logs (tests/golden/*.jsonl) replayed like fixtures: structure, statistics, determinism,
and loud failures on corrupted logs."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import numpy as np
import pytest

from services.trajectory.replay import (
    CorruptLog,
    ReplayDivergence,
    Selection,
    export_text,
    import_text,
    replay,
    tree_difference,
    verify,
)

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
SNAPSHOT = GOLDEN / "expected.json"
FILES = sorted(p.stem for p in GOLDEN.glob("*.jsonl"))


def load(name: str):  # noqa: ANN201
    return import_text((GOLDEN / f"{name}.jsonl").read_text())


def only(name: str):  # noqa: ANN201
    log = load(name)
    report = verify(log.events, log.get_blob)
    assert len(report.executions) == 1
    return report.executions[0]


def kinds(replayed) -> list[tuple[str, str]]:  # noqa: ANN001
    return [(c.kind, c.source) for c in replayed.tree.calls]


def test_golden_files_are_present() -> None:
    assert set(FILES) >= {"compaction", "delegation", "retries", "drift", "timeout", "claude_code", "group"}


def test_compaction_log_restarts_from_a_summary() -> None:
    e = only("compaction")
    assert kinds(e)[4] == ("compaction", "label")
    stats = e.tree.stats()
    assert stats.branches["compaction"] == 1 and stats.trajectories == 2
    assert e.status == "finished" and e.reward == 1.0


def test_delegation_log_has_a_sub_agent_branch() -> None:
    e = only("delegation")
    assert kinds(e)[1] == ("delegation", "label")
    assert [c.chain_id for c in e.tree.calls] == ["main", "agent-1", "agent-1", "main", "main"]
    assert e.tree.stats().trajectories == 2


def test_retries_share_their_prompt_and_count_shared_targets_once() -> None:
    e = only("retries")
    assert [k for k, _ in kinds(e)] == ["root", "retry", "retry", "continuation"]
    tree = e.tree
    assert tree.stats().trajectories == 3
    generated = sum(c.completion_len for c in tree.calls)
    # sample 1 repeats the first 5 generated tokens of sample 0 ("<shel"), sample 2 the first 21 of sample 1
    # ("<shell>echo 'port: 80"): shared generated tokens are stored and counted once
    assert tree.num_targets == generated - 5 - len("<shell>echo 'port: 80")
    prompt = tree.calls[0].prompt_len
    for i in (1, 2):
        assert tree.calls[i].shared_len >= prompt


def test_drift_log_forks_and_keeps_the_original_generation() -> None:
    e = only("drift")
    assert kinds(e)[1] == ("fork", "inferred")
    tree = e.tree
    original = tree.call_positions(0)
    completion = original[tree.calls[0].prompt_len:]
    assert tree.is_target[completion].all() and (tree.call_index[completion] == 0).all()
    rerendered = tree.call_positions(1)[tree.calls[1].shared_len: tree.calls[1].prompt_len]
    assert not tree.is_target[rerendered].any()


def test_timed_out_execution_is_scored_on_preserved_work() -> None:
    e = only("timeout")
    assert e.status == "timed_out" and e.reward == 0.5
    assert e.tree.stats().trajectories == 1 and e.tree.num_targets > 0


def test_claude_code_session_interleaves_sub_agents_and_compacts() -> None:
    e = only("claude_code")
    tree = e.tree
    chains = [c.chain_id for c in tree.calls]
    assert chains[:6] == ["title", "main", "task-1", "task-2", "task-1", "task-2"]
    assert all(source in ("inferred", "root") for _, source in kinds(e))  # no labels: all from the gateway
    stats = tree.stats()
    assert stats.branches == {"continuation": 7, "compaction": 1, "delegation": 3, "retry": 0, "fork": 0}
    assert stats.trajectories == 5  # title, two sub-agents, main before and after the compaction
    # the interleaved sub-agent calls continue their own chain, not the main one
    assert tree.calls[4].from_call_index == 2 and tree.calls[5].from_call_index == 3


def test_group_log_batch_replays_to_the_live_digest() -> None:
    log = load("group")
    report = verify(log.events, log.get_blob, Selection(step=0))
    (batch,) = report.batches
    assert batch.live_digest == batch.rebuilt_digest
    assert [x.execution_id for x in batch.rebuilt.executions] == [f"golden-group-{i}" for i in range(4)]
    rewards = [x.reward for x in batch.rebuilt.executions]
    advantages = [x.advantage for x in batch.rebuilt.executions]
    assert np.argsort(rewards).tolist() == np.argsort(advantages).tolist()
    assert batch.rebuilt.executions[3].timed_out


def _snapshot(name: str) -> dict[str, object]:
    log = load(name)
    report = replay(log.events, log.get_blob)
    return {
        "executions": {e.execution_id: {"digest": e.digest, **e.tree.stats().as_dict()} for e in report.executions},
        "batches": {str(b.step): b.rebuilt_digest for b in report.batches},
    }


@pytest.mark.parametrize("name", FILES)
def test_golden_log_matches_its_snapshot(name: str) -> None:
    """Regression guard: a change to tree building shows up as a digest or statistics change here.
    Regenerate with GYRE_UPDATE_GOLDEN=1 after checking the new trees are right."""
    current = _snapshot(name)
    expected = json.loads(SNAPSHOT.read_text()) if SNAPSHOT.exists() else {}
    if os.environ.get("GYRE_UPDATE_GOLDEN"):
        expected[name] = current
        SNAPSHOT.write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    assert expected.get(name) == current


@pytest.mark.parametrize("name", FILES)
def test_export_of_an_imported_log_is_byte_identical(name: str) -> None:
    text = (GOLDEN / f"{name}.jsonl").read_text()
    log = import_text(text)
    assert export_text(log.events, log.get_blob) == text


# ---- corrupted logs -----------------------------------------------------------------------------


def _lines(name: str) -> list[str]:
    return (GOLDEN / f"{name}.jsonl").read_text().splitlines()


def test_corrupted_blob_is_a_named_error() -> None:
    lines = _lines("retries")
    i = next(i for i, line in enumerate(lines) if '"blob"' in line)
    obj = json.loads(lines[i])
    data = bytearray(base64.b64decode(obj["blob"]["data"]))
    data[-1] ^= 0xFF
    obj["blob"]["data"] = base64.b64encode(bytes(data)).decode()
    lines[i] = json.dumps(obj)
    with pytest.raises(CorruptLog, match=f"line {i + 1}: blob should have digest"):
        import_text("\n".join(lines))


def test_missing_call_is_a_named_error() -> None:
    lines = [line for line in _lines("compaction") if '"call_index":2,' not in line]
    log = import_text("\n".join(lines))
    with pytest.raises(CorruptLog, match=r"calls \[2\] are missing"):
        replay(log.events, log.get_blob)


def test_missing_blob_is_a_named_error() -> None:
    lines = _lines("drift")
    lines = [line for line in lines if '"blob"' not in line or lines.index(line) != 1]
    log = import_text("\n".join(lines))
    with pytest.raises(CorruptLog, match="not found|not in the log"):
        replay(log.events, log.get_blob)


def test_garbage_line_is_a_named_error() -> None:
    lines = _lines("drift")
    lines.insert(3, "{not json")
    with pytest.raises(CorruptLog, match="line 4: not JSON"):
        import_text("\n".join(lines))


def test_file_without_header_is_rejected() -> None:
    with pytest.raises(CorruptLog, match="header"):
        import_text("\n".join(_lines("drift")[1:]))


def test_tampered_reward_diverges_from_the_live_batch() -> None:
    lines = _lines("group")
    for i, line in enumerate(lines):
        if '"execution.scored"' in line and "golden-group-2" in line:
            lines[i] = line.replace('"reward":0.5', '"reward":0.75')
            break
    else:
        raise AssertionError("no score line to tamper with")
    log = import_text("\n".join(lines))
    with pytest.raises(ReplayDivergence) as info:
        verify(log.events, log.get_blob)
    assert "batch 0 executions" in info.value.what and info.value.where == "entry 0"


def test_tree_difference_names_the_first_differing_position() -> None:
    a = only("drift").tree
    log = load("drift")
    b = replay(log.events, log.get_blob).executions[0].tree
    assert tree_difference(a, b) is None
    tokens = b.tokens.copy()
    tokens[17] += 1
    changed = type(b)(**{**b.__dict__, "tokens": tokens})
    found = tree_difference(a, changed)
    assert found is not None and found.where == "position 17" and "tokens" in found.what
