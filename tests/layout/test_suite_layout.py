"""The suite's layout on its workers (tests/suite_layout.py): which tests go to a worker together, and in what
order the units go out."""

from __future__ import annotations

from dataclasses import dataclass

from tests.suite_layout import is_run, longest_first, next_unit, worker_unit


@dataclass
class Item:
    nodeid: str


def test_an_end_to_end_test_is_a_unit_of_its_own_and_a_module_one_unit() -> None:
    assert worker_unit("tests/e2e/test_loop.py::test_one") == "tests/e2e/test_loop.py::test_one"
    assert worker_unit("tests/deploy/test_nodes.py::test_run") == "tests/deploy/test_nodes.py::test_run"
    assert worker_unit("tests/harness/test_sandbox.py::test_a[docker]") == "docker"
    assert worker_unit("tests/harness/test_task_images.py::test_b") == "docker"
    assert worker_unit("tests/shared/test_bus_contract.py::test_c[url]") == "tests/shared/test_bus_contract.py"


def test_units_go_out_longest_first_each_keeping_its_tests_in_order() -> None:
    items = [Item("tests/a.py::one"), Item("tests/a.py::two"), Item("tests/e2e/test_x.py::x"),
             Item("tests/deploy/test_compose_up.py::up"), Item("tests/b.py::one"),
             Item("tests/e2e/test_y.py::y"), Item("tests/new.py::unknown")]
    expected = {"tests/a.py::one": 5.0, "tests/a.py::two": 40.0, "tests/e2e/test_x.py::x": 30.0,
                "tests/deploy/test_compose_up.py::up": 500.0, "tests/b.py::one": 2.0, "tests/e2e/test_y.py::y": 90.0}
    order = [i.nodeid for i in longest_first(items, expected)]  # type: ignore[arg-type]
    assert order == ["tests/deploy/test_compose_up.py::up", "tests/e2e/test_y.py::y", "tests/a.py::one",
                     "tests/a.py::two", "tests/e2e/test_x.py::x", "tests/b.py::one", "tests/new.py::unknown"]


def test_one_run_at_a_time_while_other_units_are_left_then_side_by_side() -> None:
    assert is_run("tests/e2e/test_loop.py::test_one") and is_run("tests/deploy/test_nodes.py::test_run")
    assert not is_run("tests/rollout/test_gateway.py") and not is_run("docker")
    queue = ["tests/e2e/test_chaos.py::c", "tests/e2e/test_compare.py::c", "tests/rollout/test_vllm_gateway.py",
             "docker", "tests/e2e/test_loop.py::l"]
    # The first worker takes the longest run; the other, while it holds it, the longest unit that is no run.
    assert next_unit(queue, run_elsewhere=False) == "tests/e2e/test_chaos.py::c"
    assert next_unit(queue[1:], run_elsewhere=True) == "tests/rollout/test_vllm_gateway.py"
    assert next_unit(["docker", "tests/e2e/test_loop.py::l"], run_elsewhere=True) == "docker"
    # Nothing else left: a second run goes beside the first.
    assert next_unit(["tests/e2e/test_loop.py::l"], run_elsewhere=True) == "tests/e2e/test_loop.py::l"
