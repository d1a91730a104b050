"""Separate nodes, on one machine: three network namespaces, each a node with its own address and its own state
folder, joined by a bridge in a fourth namespace (nothing of it in the machine's own network). A three-server
NATS cluster runs across them (one server a node, JetStream replicated R3), PostgreSQL on the first.

The run is `gyre deploy` as an orchestrator would start it, each process given nothing but its node's settings:
node a prepares the run (GYRE_DEPLOY_SHARE=object: its settings and model go to the Object Store) and runs the
services; nodes b and c each run a cell agent, which fetches the run from the Object Store into the node's own
folder. The run is colocated: both cells roll out, then both train as one group of two ranks (one a node, gloo
across the bridge), whose checkpoints (both nodes' shards) go to the Object Store and are loaded from it at each
re-form; weights reach the workers through the bus. Mid-run, node b's NATS server is killed; the run goes on to
its report with every step completed once. Then, on the same cluster (two servers left), a session's KV moves
from a worker on node b to one on node c through the Object Store (tests/deploy/kv_across_nodes.py drives it).

The namespaces, the processes and the servers are the test's own and are removed when it ends."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gyre.deploy import read_env
from gyre.local import nats_server_binary
from gyre.processes import reap_strays

REPO = Path(__file__).resolve().parents[2]
STEPS = 3
NET = "10.77.{}.{}"

pytestmark = [
    pytest.mark.slow, pytest.mark.timeout(2400),
    # Creating network namespaces is the machine's privilege to give, not the project's (iproute2, which `make
    # setup` installs as root, is then there).
    pytest.mark.skipif(os.geteuid() != 0, reason="creating network namespaces needs root, which this user is not"),
]


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} failed: {result.stderr.strip()}")
    return result


@dataclass
class Node:
    name: str  # a, b, c
    ns: str
    address: str
    folder: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def popen(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = open(self.folder / f"{name}.log", "ab")
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns, *argv], env=env, cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        return proc

    def run(self, argv: list[str], env: dict[str, str], timeout: float = 900) -> str:
        result = subprocess.run(["ip", "netns", "exec", self.ns, *argv], env=env, cwd=REPO, capture_output=True,
                                text=True, timeout=timeout)
        if result.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} on node {self.name} failed ({result.returncode}):\n"
                                 f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        return result.stdout

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


class Network:
    """Three nodes on a bridge: 10.77.<net>.1-3/24, each with loopback of its own."""

    def __init__(self, tmp: Path) -> None:
        tag = uuid.uuid4().hex[:6]
        self.net = int(tag, 16) % 200 + 20
        self.switch = f"gyre-{tag}-sw"
        self.nodes = [Node(n, f"gyre-{tag}-{n}", NET.format(self.net, i + 1), tmp / n) for i, n in enumerate("abc")]
        sh("ip", "netns", "add", self.switch)
        sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i, node in enumerate(self.nodes):
            node.folder.mkdir(parents=True)
            sh("ip", "netns", "add", node.ns)
            sh("ip", "-n", node.ns, "link", "set", "lo", "up")
            sh("ip", "-n", node.ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}", "netns",
               self.switch)
            sh("ip", "-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
            sh("ip", "-n", node.ns, "addr", "add", f"{node.address}/24", "dev", "eth0")
            sh("ip", "-n", node.ns, "link", "set", "eth0", "up")

    def remove(self) -> None:
        for node in self.nodes:
            for name in list(node.procs):
                node.kill(name)
        for ns in [n.ns for n in self.nodes] + [self.switch]:
            # Whatever is left in a namespace (a daemonised server) goes with it.
            for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            sh("ip", "netns", "del", ns, check=False)


@pytest.fixture
def network(tmp_path: Path) -> Iterator[Network]:
    net = Network(tmp_path)
    try:
        yield net
    finally:
        net.remove()


def start_nats(node: Node, peers: list[Node]) -> None:
    conf = node.folder / "nats.conf"
    conf.write_text(
        f"server_name: {node.name}\nlisten: 0.0.0.0:4222\nmax_payload: 8MB\n"
        f'jetstream {{ store_dir: "{node.folder / "nats"}" }}\n'
        "cluster { name: gyre, listen: 0.0.0.0:6222, routes: ["
        + ", ".join(f"nats-route://{p.address}:6222" for p in peers) + "] }\n"
    )
    node.popen("nats", [nats_server_binary(), "-c", str(conf)], dict(os.environ))


def node_env(net: Network, node: Node, run_id: str) -> dict[str, str]:
    """What an orchestrator gives a node's processes: the cluster's addresses and the node's own identity; no
    path of another node."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GYRE_")}
    a = net.nodes[0]
    env.update({
        "GYRE_NATS_URL": ",".join(f"nats://{n.address}:4222" for n in net.nodes),
        "GYRE_STREAM_REPLICAS": "3",
        "GYRE_DATABASE_URL": f"postgresql://postgres@{a.address}:5432/postgres",
        "GYRE_RUN_ID": run_id,
        "GYRE_STATE_DIR": str(node.folder / "state"),
        "GYRE_NODE_ID": f"node-{node.name}",
        "GYRE_DEPLOY_SHARE": "object",
        # One pool of both nodes' cells, rolling out together and then training together: a trainer group of two
        # ranks, one a node, whose collectives cross the bridge and whose checkpoints hold both nodes' shards.
        "GYRE_DEPLOY_SET": f"scheduling.steps={STEPS};scheduling.mode=colocate",
        "GYRE_TRAINER_STORE_HOST": a.address,
        "GYRE_TRAINER_STORE_PORT": "29400",
        "GYRE_ROLLOUT_HOST": "0.0.0.0",
        "GYRE_ROLLOUT_PORT": "8080",
        "GYRE_HARNESS_GATEWAY_URL": f"http://{a.address}:8080",
        "GYRE_HARNESS_BACKEND": "bwrap",
        "GYRE_CELL_NODE_ID": f"node-{node.name}",
        "GLOO_SOCKET_IFNAME": "eth0",  # the ranks' collectives go over the node's own interface
        # Rank 0 also streams each publication to the workers, at its node's own address (the other node's
        # worker pulls it across the bridge; the same node's takes the handoff).
        "GYRE_TRAINER_WEIGHTS_STREAM": "true",
        "GYRE_TRAINER_WEIGHTS_STREAM_HOST": node.address,
        "XDG_RUNTIME_DIR": str(node.folder / "runtime"),
    })
    if node is not a:  # a cell node offers one of the run's two cells (`scheduling.cells` counts them all)
        env["GYRE_CELL_COUNT"] = "1"
    (node.folder / "runtime").mkdir(exist_ok=True)
    return env


QUERY = """
import json, os, sys
import psycopg
with psycopg.connect(os.environ["GYRE_DATABASE_URL"]) as c:
    print(json.dumps([list(r) for r in c.execute(sys.argv[1]).fetchall()]))
"""

OBJECTS = """
import asyncio, json, os
from shared.bus import Bus
async def main():
    bus = await Bus.connect(os.environ["GYRE_NATS_URL"], replicas=3)
    print(json.dumps(await bus.checkpoints.list_names()))
    await bus.close()
asyncio.run(main())
"""


def query(node: Node, env: dict[str, str], sql: str) -> list[list[object]]:
    return json.loads(node.run([sys.executable, "-c", QUERY, sql], env, timeout=60))


async def wait_for(what: str, check, timeout: float, nodes: list[Node]) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(check):
        for node in nodes:
            for name, proc in node.procs.items():
                assert name == "nats" or proc.poll() is None or name in ("prepare", "report"), \
                    f"{name} on node {node.name} exited ({proc.returncode}): {tail(node, name)}"
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen in {timeout:g} s\n" + "\n".join(
                f"--- {n.name}/{p}\n{tail(n, p)}" for n in nodes for p in n.procs))
        await asyncio.sleep(3.0)


def tail(node: Node, name: str) -> str:
    path = node.folder / f"{name}.log"
    return path.read_text(errors="replace")[-2500:] if path.exists() else ""


async def test_a_run_across_three_nodes_sharing_nothing_but_the_bus_survives_losing_a_nats_server(
    network: Network,
) -> None:
    a, b, c = network.nodes
    run_id = f"nodes-{uuid.uuid4().hex[:6]}"
    envs = {n.name: node_env(network, n, run_id) for n in network.nodes}
    for node in network.nodes:
        start_nats(node, [p for p in network.nodes if p is not node])
    await asyncio.to_thread(a.run, [sys.executable, "-c", (
        "from pathlib import Path; from gyre.local import EmbeddedPostgres; "
        f"EmbeddedPostgres(Path({str(a.folder)!r}), 5432, listen='0.0.0.0', "
        f"trust_network='{NET.format(network.net, 0)}/24').start()")],
        {k: v for k, v in os.environ.items() if not k.startswith("GYRE_")})  # not one of the run's processes
    gyre = [sys.executable, "-m", "gyre.cli"]
    await asyncio.to_thread(a.run, [*gyre, "migrate"], envs["a"])
    # The cell agents start first and wait for the run to appear in the Object Store.
    for node in (b, c):
        node.popen("cells", [*gyre, "deploy", "serve", "cells"], envs[node.name])
    await asyncio.to_thread(a.run, [*gyre, "deploy", "prepare", "--config", "deploy/compose/run.yaml"], envs["a"])
    for name in ("relay", "trajectory", "trainer", "gateway", "harness", "scheduler"):
        a.popen(name, [*gyre, "deploy", "serve", name], envs["a"])
    a.popen("report", [*gyre, "deploy", "report", "--timeout-s", "1800"], envs["a"])

    def steps() -> list[int]:
        rows = query(a, envs["a"], "select (data->>'step')::int from events where type = 'step.completed' "
                                   "order by position")
        return [int(r[0]) for r in rows]  # type: ignore[call-overload]

    await wait_for("the first step", lambda: len(steps()) >= 1, 1500, network.nodes)
    b.kill("nats")  # a server of the cluster, mid-run: its clients move to the other two
    await wait_for("the report", lambda: a.procs["report"].poll() is not None, 1500, network.nodes)
    assert a.procs["report"].returncode == 0, tail(a, "report")

    done = await asyncio.to_thread(steps)
    assert sorted(done) == list(range(STEPS)) and len(done) == STEPS, done
    scored = [r[0] for r in await asyncio.to_thread(
        query, a, envs["a"], "select data->>'execution_id' from events where type = 'execution.scored'")]
    assert scored and len(scored) == len(set(scored)), scored  # none lost to the failover, none scored twice
    # Weights trained on one cell's node reached the rollout worker on the other's, through the bus.
    loaded = await asyncio.to_thread(
        query, a, envs["a"], "select data->>'cell_id', (data->>'version')::int from events "
                             "where type = 'weights.loaded'")
    assert max(int(v) for _, v in loaded) >= STEPS - 1, loaded  # type: ignore[call-overload]
    # ... and at least one of them came over the weights stream from rank 0 on the other node.
    logs = {f"{node.name}/{p.name}": p.read_text(errors="replace")
            for node in (b, c) for p in node.folder.rglob("*.log")}
    assert any("weights_streamed" in text for text in logs.values()), \
        "no worker pulled weights over the stream; how each node's processes moved weights:\n" + "\n".join(
            f"{name}: {line[:300]}" for name, text in logs.items()
            for line in text.splitlines() if '"event": "weights_' in line or '"event": "rank_' in line)
    report = json.loads((a.folder / "state" / "runs" / run_id / "report.json").read_text())
    assert [row["step"] for row in report["steps"]] == list(range(STEPS))
    # b and c made their own copies of the run from the bus; neither has another node's folder in its settings.
    for node in (b, c):
        here = node.folder / "state" / "runs" / run_id
        settings = (here / "run.env").read_text()
        assert str(a.folder) not in settings and str(here) in settings
        assert (here / "model" / "config.json").is_file()
    # The checkpoints are in the Object Store, not on any node.
    names = json.loads(await asyncio.to_thread(b.run, [sys.executable, "-c", OBJECTS], envs["b"], 60))
    steps_stored = sorted({n.split("/")[1] for n in names if n.startswith(f"{run_id}/")})
    assert steps_stored and all(s.startswith("step-") for s in steps_stored), names
    for node in network.nodes:  # the folder a shared volume would hold them in was never made
        assert not (node.folder / "state" / "runs" / run_id / "checkpoints").exists(), node.name
        assert not (node.folder / "state" / "trainer" / run_id / "checkpoints").exists(), node.name

    # A session's KV moves between nodes over the bus. The run's processes (its cells' engines too) stop; a
    # second run on the same cluster serves one execution on a worker of node b's and moves it to one of c's.
    for node in network.nodes:
        for name in [n for n in node.procs if n != "nats"]:
            node.kill(name)
    await asyncio.to_thread(reap_strays, run_id)
    kv_run = f"{run_id}-kv"

    def kv_env(node: Node, **own: str) -> dict[str, str]:
        prepared = read_env(node.folder / "state" / "runs" / run_id / "run.env")
        return {**prepared, **envs[node.name], "GYRE_RUN_ID": kv_run, **own}

    a.popen("kv-relay", [*gyre, "relay"], kv_env(a))
    a.popen("kv-gateway", [sys.executable, "-m", "services.rollout", "gateway"], kv_env(a))
    for node in (b, c):
        node.popen("kv-worker", [sys.executable, "-m", "services.rollout", "worker"],
                   kv_env(node, GYRE_ROLLOUT_CELL_ID=f"kv-{node.name}"))
    out = await asyncio.to_thread(a.run, [sys.executable, "-m", "tests.deploy.kv_across_nodes", "kv-b", "kv-c"],
                                  kv_env(a), 1200)
    result = json.loads(out.strip().splitlines()[-1])
    moved = result["migrated"]
    assert (moved["from_cell"], moved["to_cell"], moved["method"]) == ("kv-b", "kv-c", "kv"), moved
    assert not moved.get("fallback"), moved
    assert moved["tokens"] >= 256 and moved["bytes"] > 0
    assert result["cells"] == ["kv-b", "kv-c"]
    # The call on node c's worker read the moved prefix from its cache instead of computing it again.
    assert result["cache_read"] >= moved["tokens"] - 128, result
