#!/bin/bash
# Median of an even-length list averages the two middle items; variance has no stray "- 1".
set -e
cd /app
sed -i 's/(ordered\[middle\] + ordered\[middle + 1\]) \/ 2/(ordered[middle - 1] + ordered[middle]) \/ 2/' stats.py
sed -i 's/ \/ len(values) - 1$/ \/ len(values)/' stats.py
python -m pytest -q -p no:cacheprovider test_stats.py
