#!/usr/bin/env bash
# The Docker engine and the local base image that the Docker sandbox backend and its tests need, made idempotent:
#   1. the engine: Debian's docker.io (and mmdebstrap) installed when either is missing (needs root);
#   2. dockerd started when no engine answers (its log in .cache/dockerd.log);
#   3. the base image (GYRE_BASE_IMAGE, gyre-base:bookworm) built when missing: no image registry is reachable,
#      so it is a Debian root made with mmdebstrap (about 20 s; debootstrap took 2-3 minutes) from the archive
#      apt already uses, streamed into `docker import`.
# Task Dockerfiles' FROM lines are mapped onto it (docs/harness.md, "Task images"). Prints one line per step;
# exits non-zero, naming the step, when one fails.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE_IMAGE="${GYRE_BASE_IMAGE:-gyre-base:bookworm}"
SUITE="${GYRE_BASE_SUITE:-bookworm}"
# What the base image carries: Python with pytest (every task's tests), `python` as a name for python3, and git
# (tasks without a Dockerfile of their own assume it, as the host has it). The image is labelled with this list
# and built again when it changes.
PACKAGES="python3,python3-pytest,python-is-python3,ca-certificates,git"
mkdir -p .cache

answers() { docker info --format '{{.ServerVersion}}' >/dev/null 2>&1; }

if ! command -v dockerd >/dev/null || ! command -v mmdebstrap >/dev/null; then
  if [ "$(id -u)" != 0 ]; then
    echo "docker-engine: dockerd or mmdebstrap missing and not root: cannot install them" >&2
    exit 1
  fi
  echo "docker-engine: installing docker.io and mmdebstrap"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io mmdebstrap >/dev/null
fi

if ! answers; then
  echo "docker-engine: starting dockerd (log: .cache/dockerd.log)"
  nohup dockerd >.cache/dockerd.log 2>&1 &
  for _ in $(seq 60); do answers && break; sleep 1; done
  answers || { echo "docker-engine: dockerd did not answer in 60 s; see .cache/dockerd.log" >&2; exit 1; }
fi

built_with="$(docker image inspect -f '{{ index .Config.Labels "gyre.packages" }}' "$BASE_IMAGE" 2>/dev/null || true)"
if [ "$built_with" != "$PACKAGES" ]; then
  # The archive the machine's apt uses (a deb822 URIs: line or a one-line `deb URL suite` entry).
  MIRROR="${GYRE_DEBIAN_MIRROR:-$(grep -hoE '^URIs: *\S+/debian/?$|^deb +\S+/debian/? ' /etc/apt/sources.list /etc/apt/sources.list.d/* 2>/dev/null \
    | head -1 | awk '{print $2}' || true)}"
  MIRROR="${MIRROR:-http://deb.debian.org/debian}"
  echo "docker-engine: building $BASE_IMAGE with mmdebstrap $SUITE from $MIRROR (about 20 s)"
  # The root streams from mmdebstrap into the import; pipefail fails the step if either side does.
  mmdebstrap --quiet --variant=minbase --include="$PACKAGES" \
    --customize-hook='rm -rf "$1"/var/cache/apt/archives/*.deb "$1"/var/lib/apt/lists/*' \
    "$SUITE" - "$MIRROR" 2>.cache/mmdebstrap.log \
    | docker import -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      -c 'CMD ["bash"]' -c "LABEL gyre.packages=$PACKAGES" - "$BASE_IMAGE" >/dev/null \
    || { echo "docker-engine: building the base image failed; see .cache/mmdebstrap.log" >&2; exit 1; }
fi
echo "docker-engine: ready ($(docker info --format '{{.ServerVersion}}'), base image $BASE_IMAGE)"
