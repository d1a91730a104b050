#!/usr/bin/env bash
# The images compose.local.yaml runs, built on this machine (no image registry needed): the Gyre image over the
# local Debian base, and PostgreSQL from Debian's packages. Needs the engine and the base (`make docker`).
#   1. deploy/build-extras/ gets the machine's own wheels (PIP_FIND_LINKS folders: e.g. the CPU build of torch)
#      and the certificate bundle pip uses here (PIP_CERT), so the build installs what `make setup` installs;
#   2. each image is built with Docker's layer cache: the dependencies' layer is rebuilt only when
#      pyproject.toml changes (about 3.5 minutes here), a change to the source costs seconds.
# Prints one line per image; exits non-zero, naming the image, when a build fails (its log in .cache/).
set -euo pipefail
cd "$(dirname "$0")/.."
BASE_IMAGE="${GYRE_BASE_IMAGE:-gyre-base:bookworm}"
IMAGE="${GYRE_IMAGE:-gyre:latest}"
EXTRAS=deploy/build-extras
mkdir -p .cache
# One build at a time (`make docker` starts one in the background; the compose test's waits for it, then finds
# every layer cached).
exec 9>.cache/build-images.lock
flock 9
docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 || { echo "build-images: no $BASE_IMAGE; run make docker" >&2; exit 1; }

for dir in ${PIP_FIND_LINKS:-} $(pip config get global.find-links 2>/dev/null || true); do
  [ -d "$dir" ] || continue
  for wheel in "$dir"/*.whl; do
    [ -e "$wheel" ] && { ln -f "$wheel" "$EXTRAS/" 2>/dev/null || cp -f "$wheel" "$EXTRAS/"; }
  done
done
cert="${PIP_CERT:-$(pip config get global.cert 2>/dev/null || true)}"
[ -n "$cert" ] && [ -f "$cert" ] && cp -f "$cert" "$EXTRAS/ca-bundle.crt"

# GYRE_BUILD_CPUS caps the CPU the build's steps take (they run in the engine's containers, so `nice` on this
# script would not reach them): `make docker` builds in the background beside the test suite with 0.5.
limits=()
if [ -n "${GYRE_BUILD_CPUS:-}" ]; then
  limits=(--cpu-period=100000 --cpu-quota="$(awk -v c="$GYRE_BUILD_CPUS" 'BEGIN { printf "%d", c * 100000 }')")
fi
build() {  # name, log, docker build arguments...
  local name="$1" log="$2"; shift 2
  local started=$SECONDS
  docker build "${limits[@]}" "$@" >"$log" 2>&1 || { echo "build-images: building $name failed; see $log" >&2; tail -5 "$log" >&2; exit 1; }
  echo "build-images: $name ready ($((SECONDS - started)) s)"
}
build "$IMAGE" .cache/build-gyre.log -f deploy/Dockerfile -t "$IMAGE" --build-arg BASE="$BASE_IMAGE" \
  --build-arg SYSTEM_PACKAGES="python3-venv python3-dev bubblewrap git libnuma1 g++" --build-arg TORCH_INDEX=https://pypi.org/simple .
build gyre-postgres:local .cache/build-postgres.log -f deploy/local/postgres.Dockerfile -t gyre-postgres:local \
  --build-arg BASE="$BASE_IMAGE" deploy/local
