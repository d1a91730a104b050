#!/bin/bash
cd /app
tr a-z A-Z < specs/m1.txt > src/m1.txt
LC_ALL=C sort specs/m2.txt > src/m2.txt
grep -c ERROR specs/m3.txt > src/m3.txt
