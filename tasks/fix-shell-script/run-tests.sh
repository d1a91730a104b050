#!/bin/bash
cd "${WORKDIR:-/app}"
python -P -m pytest -rA -p no:cacheprovider "$TEST_DIR/test_outputs.py"
