"""`python -m tests.trainer.blocking_rank rank`: a real rank process whose step `GYRE_TEST_BLOCK_STEP` never
finishes: it touches `GYRE_TEST_BLOCKED_FILE` and waits there (before any collective) until the test kills it, so
"killed mid-step" is certain, not a race with a step that takes a tenth of a second."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from services.trainer import rank
from services.trainer.rank_work import RankWork


def main() -> None:
    block = int(os.environ["GYRE_TEST_BLOCK_STEP"])
    marker = Path(os.environ["GYRE_TEST_BLOCKED_FILE"])
    real_step = RankWork.step

    def step(self: RankWork, request, batch_bytes: bytes, rank_id: str):  # noqa: ANN001, ANN202
        if request.step == block:
            marker.write_text(rank_id)
            threading.Event().wait()  # until the process is killed
        return real_step(self, request, batch_bytes, rank_id)

    RankWork.step = step  # type: ignore[method-assign]
    rank.main()


if __name__ == "__main__":
    main()
