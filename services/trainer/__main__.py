"""`python -m services.trainer [coordinator|rank]`: the trainer coordinator (the default: batch.ready in,
step.completed and weights.published out), or a trainer rank standing by on its cell (`GYRE_TRAINER_CELL_ID`)."""

import sys

if __name__ == "__main__":
    role = sys.argv[1] if len(sys.argv) > 1 else "coordinator"
    if role == "rank":
        from services.trainer.rank import main

        main()
    elif role == "coordinator":
        from services.trainer.service import TrainerService

        TrainerService.main()
    else:
        raise SystemExit(f"expected coordinator or rank, got {role!r}")
