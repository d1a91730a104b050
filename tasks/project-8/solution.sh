#!/bin/bash
cd /app
grep -c INFO specs/m1.txt > src/m1.txt
LC_ALL=C sort specs/m2.txt > src/m2.txt
awk '{s+=$1} END {print s}' specs/m3.txt > src/m3.txt
LC_ALL=C sort specs/m4.txt > src/m4.txt
grep -c WARN specs/m5.txt > src/m5.txt
tr a-z A-Z < specs/m6.txt > src/m6.txt
