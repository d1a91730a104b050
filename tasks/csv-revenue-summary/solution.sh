#!/bin/bash
set -e
cd /app
python - <<'PY'
import csv
from collections import defaultdict
from decimal import Decimal
revenue = defaultdict(Decimal)
for row in csv.DictReader(open("sales.csv")):
    revenue[row["region"]] += Decimal(row["units"]) * Decimal(row["unit_price"])
with open("summary.csv", "w") as out:
    out.write("region,revenue\n")
    for region in sorted(revenue):
        out.write(f"{region},{revenue[region]:.2f}\n")
PY
