#!/bin/bash
# This task is scored through the reward file rather than the pytest summary.
cd "${WORKDIR:-/app}"
python "$TEST_DIR/check_settings.py"
