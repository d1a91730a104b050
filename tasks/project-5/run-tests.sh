#!/bin/bash
# Runs the task's tests against the working directory; pytest's -rA summary is what gets scored.
cd "${WORKDIR:-/app}"
python -P -m pytest -rA -p no:cacheprovider "$TEST_DIR/test_outputs.py"
