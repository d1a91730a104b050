#!/bin/bash
cd /app
grep -c ERROR specs/m1.txt > src/m1.txt
grep -c ERROR specs/m2.txt > src/m2.txt
grep -c INFO specs/m3.txt > src/m3.txt
grep -c ERROR specs/m4.txt > src/m4.txt
awk '{s+=$1} END {print s}' specs/m5.txt > src/m5.txt
