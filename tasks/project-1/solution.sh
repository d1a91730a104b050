#!/bin/bash
cd /app
awk '{s+=$1} END {print s}' specs/m1.txt > src/m1.txt
LC_ALL=C sort specs/m2.txt > src/m2.txt
grep -c WARN specs/m3.txt > src/m3.txt
