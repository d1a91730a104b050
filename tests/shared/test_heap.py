"""`freeze_startup_heap`, run in a process of its own (freezing is for the process's whole life)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_freezing_hides_the_startup_heap_from_collections_but_later_garbage_is_still_collected() -> None:
    script = textwrap.dedent(
        """
        import gc
        from shared.runtime import freeze_startup_heap

        startup = [[i] for i in range(50_000)]  # alive across the freeze, as an imported library's objects are
        gone = []
        gone.append(gone)  # garbage in a cycle before the freeze: collected first, not frozen
        del gone
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() and frozen > len(startup), frozen
        assert sum(len(generation) for generation in (gc.get_objects(0), gc.get_objects(1), gc.get_objects(2))) < frozen
        later = []
        later.append(later)  # garbage made after the freeze is still found
        del later
        assert gc.collect() >= 1
        print(frozen)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.strip()) > 50_000
