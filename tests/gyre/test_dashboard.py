"""The dashboard's read model and app: views of golden logs, the same answers from the event store and from an
exported file, live updates as events arrive, and the app's errors, read-only rule and token."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from gyre.dashboard.app import COOKIE, create_app
from gyre.dashboard.source import FileEvents, ReadModel, StoreEvents
from gyre.dashboard.views import DROPPED, KIND_COLOURS, executions
from services.trajectory.replay import LoadedLog, import_text, referenced_blobs
from shared.store import EventStore

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


async def load_into(store: EventStore, log: LoadedLog, *, chunk: int = 400) -> None:
    """Append an exported log's events (their own versions) and blobs to `store`."""
    blobs = [(log.blobs[r.digest], r.media_type) for r in referenced_blobs(log.events)]
    for start in range(0, len(log.events), chunk):
        await store.append(log.events[start:start + chunk], blobs=blobs if start == 0 else ())


def golden(name: str) -> LoadedLog:
    return import_text((GOLDEN / f"{name}.jsonl").read_text())


async def test_a_tree_is_drawn_with_its_branch_kinds_and_what_the_cap_keeps():
    model = ReadModel(FileEvents(GOLDEN / "retries.jsonl"), cap_k=8)
    (run,) = await model.runs()
    view = await model.run(run["run_id"])
    assert view is not None
    (row,) = view["executions"]
    tree = await model.tree(run["run_id"], row["execution_id"])
    icicle = tree["figure"]["data"][0]
    assert icicle["type"] == "icicle" and len(icicle["ids"]) == tree["stats"]["nodes"]
    # One root box (the prompt every trajectory shares); every other box hangs under another. A box is as wide
    # as the trajectories through it: its children's together, or one for a leaf.
    assert icicle["parents"].count("") == 1 and set(icicle["parents"]) - {""} <= set(icicle["ids"])
    width = dict(zip(icicle["ids"], icicle["values"]))
    for box, value in width.items():
        below = [width[c] for c, p in zip(icicle["ids"], icicle["parents"]) if p == box]
        assert value == (sum(below) if below else 1)
    assert icicle["values"][0] == tree["trajectories"] == tree["stats"]["trajectories"]
    assert sum(n["tokens"] for n in tree["nodes"]) == tree["stats"]["unique_tokens"]
    assert tree["kinds"] == {"retry": KIND_COLOURS["retry"], "root": KIND_COLOURS["root"]}
    assert tree["trajectories"] == tree["trajectories_kept"] == 3 and DROPPED not in icicle["marker"]["colors"]
    assert sum(n["targets"] for n in tree["nodes"]) == tree["stats"]["target_tokens"]

    # A cap of one keeps the final call's trajectory: the other branches are grey and do not train.
    capped = await ReadModel(FileEvents(GOLDEN / "retries.jsonl"), cap_k=1).tree(run["run_id"], row["execution_id"])
    dropped = [n for n, c in zip(capped["nodes"], capped["figure"]["data"][0]["marker"]["colors"]) if c == DROPPED]
    assert capped["trajectories_kept"] == 1 and dropped and not any(n["trains"] for n in dropped)
    assert capped["targets_kept"] + capped["targets_dropped"] == tree["stats"]["target_tokens"]


async def test_the_run_view_shows_executions_curves_and_branches():
    log = golden("group")
    model = ReadModel(FileEvents(GOLDEN / "group.jsonl"), cap_k=8)
    view = await model.run("golden-run")
    assert view is not None
    assert view["summary"]["executions"] == {"scored": 4} and view["summary"]["branches"] == {"retry": 1}
    assert [t["name"] for t in view["curves"]["data"]] == ["mean reward", "pass rate", "loss"]
    rows = executions(log.events)
    assert [r["execution_id"] for r in view["executions"]] == [r.execution_id for r in rows]
    assert all(r.calls > 0 and r.reward is not None for r in rows)
    calls = await model.calls("golden-run", rows[0].execution_id)
    assert [c["call_index"] for c in calls] == list(range(rows[0].calls))
    call = await model.call("golden-run", rows[0].execution_id, 0)
    assert len(call["completion"]) == call["completion_tokens"] == len(call["logprobs"])
    assert len(call["new_prompt"]) == call["new_prompt_tokens"]


@pytest.mark.parametrize("name", ["group", "delegation", "compaction"])
async def test_the_store_and_an_exported_file_give_the_same_views(store: EventStore, name: str):
    """One contract over both sources: the event store (live) and an exported log (a record)."""
    log = golden(name)
    await load_into(store, log)
    from_store = ReadModel(StoreEvents(store), cap_k=8)
    from_file = ReadModel(FileEvents(GOLDEN / f"{name}.jsonl"), cap_k=8)
    (a,), (b,) = await from_store.runs(), await from_file.runs()
    assert (a["run_id"], a["events"]) == (b["run_id"], b["events"]) == (log.events[0].run_id, len(log.events))
    va, vb = await from_store.run(a["run_id"]), await from_file.run(b["run_id"])
    assert va is not None and vb is not None
    assert {**va, "position": 0} == {**vb, "position": 0}
    for row in va["executions"]:
        ta = await from_store.tree(a["run_id"], row["execution_id"])
        tb = await from_file.tree(a["run_id"], row["execution_id"])
        assert ta == tb and ta["digest"] == tb["digest"]


async def test_a_live_run_is_read_from_where_it_was(store: EventStore):
    """Events that arrive after a view show in the next one; a poll with nothing new answers nothing."""
    log = golden("group")
    half = len(log.events) // 2
    blobs = [(log.blobs[r.digest], r.media_type) for r in referenced_blobs(log.events)]
    await store.append(log.events[:half], blobs=blobs)
    model = ReadModel(StoreEvents(store), cap_k=8)
    first = await model.run("golden-run")
    assert first is not None and await model.run("golden-run", since=first["position"]) is None
    await store.append(log.events[half:])
    second = None
    for _ in range(100):  # a view is folded again at most every 4x its last fold's time: a later poll has it
        if (second := await model.run("golden-run", since=first["position"])) is not None:
            break
        await asyncio.sleep(0.05)
    assert second is not None and second["position"] > first["position"]
    assert second["summary"]["events"] == len(log.events) > first["summary"]["events"]
    assert sum(second["summary"]["executions"].values()) == 4


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dash")


async def test_the_app_serves_the_page_plotly_and_json_and_names_what_is_missing():
    app = create_app(ReadModel(FileEvents(GOLDEN / "delegation.jsonl"), cap_k=8))
    async with client(app) as http:
        page = await http.get("/")
        assert page.status_code == 200 and "vendor/plotly.min.js" in page.text
        js = await http.get("/vendor/plotly.min.js")
        assert js.status_code == 200 and len(js.content) > 1_000_000 and b"plotly" in js.content[:2000].lower()
        assert (await http.get("/static/dashboard.js")).status_code == 200
        (run,) = (await http.get("/api/runs")).json()
        view = (await http.get(f"/api/runs/{run['run_id']}")).json()
        assert (await http.get(f"/api/runs/{run['run_id']}", params={"since": view["position"]})).status_code == 204
        missing = await http.get("/api/runs/nope")
        assert missing.status_code == 404 and "no run 'nope'" in missing.json()["detail"]
        missing = await http.get(f"/api/runs/{run['run_id']}/executions/nope/tree")
        assert missing.status_code == 404 and "no execution 'nope'" in missing.json()["detail"]
        bad = await http.get(f"/api/runs/{run['run_id']}/executions/x/calls/minus-one")
        assert bad.status_code == 422
        assert (await http.post("/api/runs")).status_code == 405  # read-only
        assert (await http.delete(f"/api/runs/{run['run_id']}")).status_code == 405


async def test_beyond_localhost_the_app_asks_for_its_token():
    from gyre.dashboard.cli import is_local

    assert is_local("127.0.0.1") and is_local("localhost") and is_local("::1")
    assert not is_local("0.0.0.0") and not is_local("10.1.2.3") and not is_local("dash.example")
    app = create_app(ReadModel(FileEvents(GOLDEN / "delegation.jsonl"), cap_k=8), token="s3cret")
    async with client(app) as http:
        refused = await http.get("/api/runs")
        assert refused.status_code == 401 and "token" in refused.json()["detail"]
        assert (await http.get("/api/runs", headers={"Authorization": "Bearer wrong"})).status_code == 401
        assert (await http.get("/api/runs", headers={"Authorization": "Bearer s3cret"})).status_code == 200
        page = await http.get("/", params={"token": "s3cret"})  # the URL printed; the cookie carries it on
        assert page.status_code == 200 and page.cookies.get(COOKIE) == "s3cret"
        assert (await http.get("/api/runs")).status_code == 200


def test_the_command_names_a_log_file_it_cannot_read(tmp_path: Path):
    import subprocess
    import sys

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"nope": 1}\n')
    for path, says in ((bad, "line 1"), (tmp_path / "missing.jsonl", "No such file")):
        result = subprocess.run([sys.executable, "-m", "gyre", "dashboard", "--log", str(path)],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and says in result.stderr and "Traceback" not in result.stderr
