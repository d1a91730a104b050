#!/bin/bash
cd /app
tr a-z A-Z < specs/m1.txt > src/m1.txt
awk '{s+=$1} END {print s}' specs/m2.txt > src/m2.txt
awk '{s+=$1} END {print s}' specs/m3.txt > src/m3.txt
