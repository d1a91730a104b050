#!/bin/bash
# Builds and tests the project: every module, or the ones named. A full build takes 17.5 s, one module
# its share. Prints "ok <module>" or "FAIL <module>: <what it must hold>" per module; exit 1 if any failed.
cd "$(dirname "$0")"
if [ $# -gt 0 ]; then modules="$*"; sleep 5.83
else modules="m1 m2 m3"; sleep 17.5; fi
fail=0
for m in $modules; do
  case $m in
    m1) want="$(awk '{s+=$1} END {print s}' specs/m1.txt)"; what='the sum of the numbers in specs/m1.txt' ;;
    m2) want="$(tr a-z A-Z < specs/m2.txt)"; what='specs/m2.txt in upper case' ;;
    m3) want="$(tr a-z A-Z < specs/m3.txt)"; what='specs/m3.txt in upper case' ;;
    *) echo "FAIL $m: no such module"; fail=1; continue ;;
  esac
  if [ -f "src/$m.txt" ] && [ "$(cat "src/$m.txt")" = "$want" ]; then echo "ok $m"
  else echo "FAIL $m: src/$m.txt must hold $what"; fail=1; fi
done
exit $fail
