#!/usr/bin/env bash
# The CUDA paths to trust before a long run on GPUs, each run as the tests that check it, then a pass/fail table.
#
#   deploy/gpu-check.sh            on a machine with the gpu extra installed (pip install '.[gpu]') and a GPU
#   deploy/gpu-check.sh --list     the checks and the tests behind them (nothing runs)
#
# The vLLM tests take the GPU when vLLM's platform is CUDA (their engines are started as the workers start
# theirs); tests/gpu holds the checks that exist only for CUDA. A check that needs two GPUs is skipped on one.
# Exit status: 0 when no check failed, 1 when one did, 2 when there is no CUDA device to check.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

CHECKS=(
  "vLLM on GPU: in-place weight reload|tests/trainer/test_weights.py::test_published_weights_reload_in_place_in_vllm"
  "vLLM on GPU: sleep and wake with weights reloaded|tests/rollout/test_vllm_standby.py::test_an_engine_that_slept_and_woke_with_its_weights_reloaded_samples_as_before"
  "weights stream into a GPU engine|tests/rollout/test_vllm_standby.py::test_weights_streamed_from_rank_0_swap_in_and_a_refused_stream_keeps_the_old_ones"
  "weights stream lands on the GPU (gloo)|tests/gpu/test_cuda_paths.py::test_the_weights_stream_lands_on_a_cuda_engine_device"
  "weights stream GPU to GPU (NCCL, 2 GPUs)|tests/gpu/test_cuda_paths.py::test_the_weights_stream_over_nccl_goes_gpu_to_gpu"
  "two-rank NCCL FSDP2 step (2 GPUs)|tests/gpu/test_cuda_paths.py::test_a_two_rank_nccl_fsdp2_step_equals_one_rank"
  "flex attention tree packing = dense|tests/gpu/test_cuda_paths.py::test_tree_packing_with_flex_attention_on_cuda_equals_dense"
  "KV move between two engines|tests/rollout/test_vllm_migration.py"
)

if [ "${1:-}" = "--list" ]; then
  for c in "${CHECKS[@]}"; do printf '%s\t%s\n' "${c%%|*}" "${c#*|}"; done
  exit 0
fi

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu-check: no CUDA device here (torch.cuda.is_available() is False): nothing to check" >&2
  exit 2
fi
"$PY" -c "import torch; print('gpu-check:', torch.cuda.device_count(), 'x', torch.cuda.get_device_name(0), \
'| torch', torch.__version__, '| CUDA', torch.version.cuda)"

out=$(mktemp -d)
rows=()
failed=0
for i in "${!CHECKS[@]}"; do
  name=${CHECKS[$i]%%|*}
  target=${CHECKS[$i]#*|}
  started=$(date +%s)
  "$PY" -m pytest -q -p no:cacheprovider -p no:xdist -o addopts="" -rs "$target" --junitxml="$out/$i.xml" \
    >"$out/$i.log" 2>&1
  rc=$?
  seconds=$(( $(date +%s) - started ))
  verdict=$("$PY" - "$out/$i.xml" "$rc" <<'EOF'
import sys
import xml.etree.ElementTree as ET

path, rc = sys.argv[1], int(sys.argv[2])
try:
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
except (OSError, ET.ParseError, AttributeError):
    print("FAIL (no result: see its log)")
    sys.exit()
if counts["failures"] or counts["errors"] or rc != 0 or not counts["tests"]:
    print("FAIL" if counts["tests"] else "FAIL (no test ran)")
elif counts["tests"] and counts["skipped"] == counts["tests"]:
    reason = next((s.get("message", "") for s in suite.iter("skipped")), "")
    print(f"skip ({reason.removeprefix('Skipped: ')[:60]})")
else:
    print("pass")
EOF
)
  [ "${verdict%% *}" = "FAIL" ] && failed=1
  rows+=("$(printf '%-48s %-40s %5ss' "$name" "$verdict" "$seconds")")
done

printf '\n%-48s %-40s %6s\n' "check" "result" "time"
printf '%s\n' "${rows[@]}"
echo "logs: $out"
exit $failed
