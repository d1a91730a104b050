"""`python -m services.scheduler [serve|cell]`: the live scheduler (default) or this node's cell agent."""

import sys

from services.scheduler.cli import scheduler_app

if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.argv.append("serve")
    scheduler_app(prog_name="python -m services.scheduler")
