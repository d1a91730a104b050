#!/bin/bash
cd /app
awk '{s+=$1} END {print s}' specs/m1.txt > src/m1.txt
tr a-z A-Z < specs/m2.txt > src/m2.txt
tr a-z A-Z < specs/m3.txt > src/m3.txt
tr a-z A-Z < specs/m4.txt > src/m4.txt
awk '{s+=$1} END {print s}' specs/m5.txt > src/m5.txt
tr a-z A-Z < specs/m6.txt > src/m6.txt
