#!/bin/bash
set -e
cd /app
python - <<'PY'
import configparser, json
parser = configparser.ConfigParser()
parser.read("settings.ini")

def convert(value):
    if value in ("true", "false"):
        return value == "true"
    try:
        return int(value)
    except ValueError:
        return value

json.dump({s: {k: convert(v) for k, v in parser[s].items()} for s in parser.sections()}, open("settings.json", "w"), indent=2)
PY
