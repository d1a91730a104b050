#!/bin/bash
cd /app
LC_ALL=C sort specs/m1.txt > src/m1.txt
tr a-z A-Z < specs/m2.txt > src/m2.txt
LC_ALL=C sort specs/m3.txt > src/m3.txt
tr a-z A-Z < specs/m4.txt > src/m4.txt
tr a-z A-Z < specs/m5.txt > src/m5.txt
