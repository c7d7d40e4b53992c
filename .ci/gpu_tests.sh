#!/usr/bin/env bash
# The cuda test tier on a lent GPU, in two passes: the kernel-only modules in parallel (xdist; they
# compile many Triton variants), then the runtime and runner modules one at a time. Args: extra
# pytest args for both passes. Logs in $OUT.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
KERNEL_MODULES="tests/test_kernels_cuda.py tests/test_kernels_hadamard_cuda.py tests/test_comm_zero_copy.py"
timeout ${T_KERNELS:-200} python3 -m pytest -m cuda -q -rfEs -n ${XDIST:-8} -p no:cacheprovider $KERNEL_MODULES "$@" >"$OUT/cuda_kernels.log" 2>&1; echo "kernels pass rc=$?" >>"$OUT/cuda_kernels.log"
ignores=""; for m in $KERNEL_MODULES; do ignores="$ignores --ignore=$m"; done
timeout ${T_RUNTIME:-330} python3 -m pytest -m cuda -v -rfEs --durations=12 --timeout=150 -p no:cacheprovider $ignores ${K:+-k "$K"} "$@" >"$OUT/cuda_runtime.log" 2>&1; echo "runtime pass rc=$?" >>"$OUT/cuda_runtime.log"
echo "== kernels"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|rc=" "$OUT/cuda_kernels.log" | cut -c1-300 | tail -20
echo "== runtime"; grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|rc=" "$OUT/cuda_runtime.log" | cut -c1-250 | tail -40
