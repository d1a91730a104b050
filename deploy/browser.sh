#!/usr/bin/env bash
# Debian's Chromium and its chromedriver, for the dashboard's browser test (tests/gyre/test_dashboard_browser.py):
# installed when either is missing (needs root; about a minute). No browser is downloaded by a test tool: the
# test drives this one through Selenium with the driver's path given. Exits non-zero, saying why, when it cannot.
set -euo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "browser: chromium or chromedriver missing and not root: cannot install them" >&2
  exit 1
fi
echo "browser: installing chromium and chromium-driver"
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1 \
  || { apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null; }
