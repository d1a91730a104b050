"""Grades ini-to-json by writing a reward (fraction of checks passed) to $REWARD_FILE."""

import json
import os
from pathlib import Path

EXPECTED = {
    "server": {"host": "127.0.0.1", "port": 8080, "debug": False},
    "cache": {"enabled": True, "ttl": 300, "backend": "redis"},
    "features": {"beta": True, "max_users": 25},
}


def checks():
    path = Path("/app/settings.json")
    if not path.is_file():
        return [False] * (1 + len(EXPECTED))
    try:
        data = json.loads(path.read_text())
    except ValueError:
        return [False] * (1 + len(EXPECTED))
    results = [isinstance(data, dict) and sorted(data) == sorted(EXPECTED)]
    for section, values in EXPECTED.items():
        got = data.get(section) if isinstance(data, dict) else None
        # `type(...) is` so that True never passes for 1, nor "8080" for 8080.
        results.append(
            isinstance(got, dict)
            and got == values
            and all(type(got[k]) is type(v) for k, v in values.items())
        )
    return results


if __name__ == "__main__":
    results = checks()
    reward = sum(results) / len(results)
    print(f"checks passed: {sum(results)}/{len(results)}")
    Path(os.environ["REWARD_FILE"]).write_text(f"{reward}\n")
