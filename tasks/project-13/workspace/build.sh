#!/bin/bash
# Builds and tests the project: every module, or the ones named. A full build takes 5.4 s, one module
# its share. Prints "ok <module>" or "FAIL <module>: <what it must hold>" per module; exit 1 if any failed.
cd "$(dirname "$0")"
if [ $# -gt 0 ]; then modules="$*"; sleep 1.8
else modules="m1 m2 m3"; sleep 5.4; fi
fail=0
for m in $modules; do
  case $m in
    m1) want="$(grep -c INFO specs/m1.txt)"; what='the number of lines of specs/m1.txt that contain INFO' ;;
    m2) want="$(tr a-z A-Z < specs/m2.txt)"; what='specs/m2.txt in upper case' ;;
    m3) want="$(LC_ALL=C sort specs/m3.txt)"; what='the lines of specs/m3.txt sorted' ;;
    *) echo "FAIL $m: no such module"; fail=1; continue ;;
  esac
  if [ -f "src/$m.txt" ] && [ "$(cat "src/$m.txt")" = "$want" ]; then echo "ok $m"
  else echo "FAIL $m: src/$m.txt must hold $what"; fail=1; fi
done
exit $fail
