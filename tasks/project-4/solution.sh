#!/bin/bash
cd /app
grep -c ERROR specs/m1.txt > src/m1.txt
awk '{s+=$1} END {print s}' specs/m2.txt > src/m2.txt
awk '{s+=$1} END {print s}' specs/m3.txt > src/m3.txt
awk '{s+=$1} END {print s}' specs/m4.txt > src/m4.txt
