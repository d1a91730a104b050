#!/bin/bash
cd /app
LC_ALL=C sort specs/m1.txt > src/m1.txt
grep -c ERROR specs/m2.txt > src/m2.txt
grep -c INFO specs/m3.txt > src/m3.txt
grep -c WARN specs/m4.txt > src/m4.txt
