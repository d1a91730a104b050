"""How `make test` lays the suite out on its pytest-xdist workers (docs/testing.md, "The layout").

A unit goes to one worker whole: each end-to-end test is a unit of its own (a whole `gyre run`, a compose project,
the three-node run: each on servers, schemas and subject prefixes of its own); the modules that start Docker
containers are one unit together (no two of them name a container alike at once); any other module is one unit
(its module-scoped fixtures, a vLLM engine say, start once).

Units go out longest first, by tests/expected_times.json, and a worker takes its next unit as it starts the last
test of the one before. One end-to-end run at a time while anything else is left: a worker whose peer holds a run
takes the longest other unit instead. The suite is bound by the cores (it keeps two about 85-90% busy, most of it
starting vLLM engines and trainer ranks), and two runs side by side each took 1.2-2.5 times as long as alone and
spent a quarter more CPU between them (processes that live longer cost more), so the runs go one after the other
while the ~250 short modules fill the other core, and side by side only at the end, when nothing else is left.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import pytest

from tests.timing import EXPECTED

# Whole-loop runs: each a unit of its own.
E2E_MODULES = ("tests/e2e/", "tests/deploy/test_compose_up.py", "tests/deploy/test_nodes.py")
# Test modules that start Docker containers: one unit, so no two of them name a container alike at once.
DOCKER_MODULES = {"tests/harness/test_sandbox.py", "tests/harness/test_docker_sandbox.py",
                  "tests/harness/test_task_images.py"}
UNKNOWN_TEST_S = 1.0  # a test with no expected time yet (a new one): as short as most


def worker_unit(nodeid: str) -> str:
    """The unit a test goes to a worker in: itself (an end-to-end test), the Docker modules' unit, or its module."""
    module = nodeid.split("::", 1)[0]
    if module.startswith(E2E_MODULES):
        return nodeid
    return "docker" if module in DOCKER_MODULES else module


def is_run(unit: str) -> bool:
    """Whether the unit is an end-to-end test's (a whole run of its own)."""
    return "::" in unit and unit.startswith(E2E_MODULES)


def longest_first(items: list[pytest.Item], expected: dict[str, float]) -> list[pytest.Item]:
    """`items` with their units in the order they go out, longest first by their tests' expected seconds; a unit's
    own tests keep their order."""
    seconds: defaultdict[str, float] = defaultdict(float)
    for item in items:
        seconds[worker_unit(item.nodeid)] += expected.get(item.nodeid, UNKNOWN_TEST_S)
    order = {item.nodeid: i for i, item in enumerate(items)}
    return sorted(items, key=lambda item: (-seconds[worker_unit(item.nodeid)], worker_unit(item.nodeid),
                                           order[item.nodeid]))


def next_unit(queue: list[str], *, run_elsewhere: bool) -> str:
    """The unit a worker takes next from the queue (in the order units go out): the first, unless another worker
    holds an end-to-end run and a unit that is not one is left, which it takes instead."""
    if run_elsewhere:
        return next((unit for unit in queue if not is_run(unit)), queue[0])
    return queue[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    expected: dict[str, float] = json.loads(EXPECTED.read_text()) if EXPECTED.is_file() else {}
    items[:] = longest_first(items, expected)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With `--dist loadgroup`: pytest-xdist's scope scheduler over `worker_unit`'s units in the collection's order
    (`--no-loadscope-reorder`), a worker given its next unit once it holds one test not yet done. (xdist's own
    loadgroup reads `xdist_group` marks through a node id attribute pytest 9.2 no longer has; and its scope
    scheduler tops a worker up while it holds two tests, which would queue a second long run behind the first on
    one worker while the other worker is still free for it.) A worker runs a test only once it knows the next one,
    so it must be sent its next unit while it still holds the last test of the one before, not after. A run queued
    on a worker counts as held there: the runs line up on one worker while the other takes the rest."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_unit(nodeid)

        def _assign_work_unit(self, node: Any) -> None:  # LoadScopeScheduling's, with `next_unit`'s choice
            run_elsewhere = any(is_run(scope) and not all(tests.values())
                                for other, work in self.assigned_work.items() if other is not node
                                for scope, tests in work.items())
            scope = next_unit(list(self.workqueue), run_elsewhere=run_elsewhere)
            work_unit = self.workqueue.pop(scope)
            self.assigned_work.setdefault(node, {})[scope] = work_unit
            collection = self.registered_collections[node]
            node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])

        def _reschedule(self, node: Any) -> None:
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
                return
            if self._pending_of(self.assigned_work[node]) > 1:
                return
            self._assign_work_unit(node)

    return UnitScheduling(config, log)
