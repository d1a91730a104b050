"""`python -m services.rollout worker|gateway`: a rollout worker for one cell, or the gateway."""

from services.rollout.service import main

if __name__ == "__main__":
    main()
