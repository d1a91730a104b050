#!/bin/bash
# Undo the last commit's change to the comparison, as a new commit.
set -e
cd /app
git diff HEAD~1 HEAD -- intervals/merge.py
sed -i 's/if start < merged\[-1\]\[1\]:/if start <= merged[-1][1]:/' intervals/merge.py
git -c user.name=agent -c user.email=agent@example.com commit -qam "intervals: merge ranges that touch again"
