#!/bin/bash
# Builds and tests the project: every module, or the ones named. A full build takes 6.0 s, one module
# its share. Prints "ok <module>" or "FAIL <module>: <what it must hold>" per module; exit 1 if any failed.
cd "$(dirname "$0")"
if [ $# -gt 0 ]; then modules="$*"; sleep 2.0
else modules="m1 m2 m3"; sleep 6.0; fi
fail=0
for m in $modules; do
  case $m in
    m1) want="$(awk '{s+=$1} END {print s}' specs/m1.txt)"; what='the sum of the numbers in specs/m1.txt' ;;
    m2) want="$(LC_ALL=C sort specs/m2.txt)"; what='the lines of specs/m2.txt sorted' ;;
    m3) want="$(grep -c WARN specs/m3.txt)"; what='the number of lines of specs/m3.txt that contain WARN' ;;
    *) echo "FAIL $m: no such module"; fail=1; continue ;;
  esac
  if [ -f "src/$m.txt" ] && [ "$(cat "src/$m.txt")" = "$want" ]; then echo "ok $m"
  else echo "FAIL $m: src/$m.txt must hold $what"; fail=1; fi
done
exit $fail
