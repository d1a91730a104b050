#!/bin/bash
set -e
cd /app
python - <<'PY'
import collections, json
lines = [l for l in open("access.log").read().splitlines() if l.strip()]
status = collections.Counter(l.split('"')[2].split()[0] for l in lines)
paths = collections.Counter(l.split('"')[1].split()[1] for l in lines)
report = {
    "total_requests": len(lines),
    "status_counts": dict(sorted(status.items())),
    "top_path": paths.most_common(1)[0][0],
    "unique_ips": len({l.split()[0] for l in lines}),
    "error_rate": round(sum(c for s, c in status.items() if s.startswith("5")) / len(lines), 3),
}
json.dump(report, open("report.json", "w"), indent=2)
PY
