#!/bin/bash
cd /app
awk '{s+=$1} END {print s}' specs/m1.txt > src/m1.txt
tr a-z A-Z < specs/m2.txt > src/m2.txt
grep -c ERROR specs/m3.txt > src/m3.txt
awk '{s+=$1} END {print s}' specs/m4.txt > src/m4.txt
