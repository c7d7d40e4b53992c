#!/usr/bin/env bash
# GPU proof on a lent CUDA machine (not CI): the cuda test tier, the kernel and one-GPU benchmarks,
# and the doctor when present. Logs land in $OUT (or ./gpu-proof-out). Needs the wheels that the
# image lacks (hydra-core, omegaconf, antlr4) in .whl/ when they are not installed.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())"; } | tee "$OUT/versions.txt"
T_TESTS=${T_TESTS:-300}; T_KERN=${T_KERN:-90}; T_GPU=${T_GPU:-150}
timeout "$T_TESTS" python3 -m pytest -m cuda -q -rA --timeout=150 -p no:cacheprovider ${PYTEST_ARGS:-} >"$OUT/cuda_tests.log" 2>&1; echo "pytest rc=$?" | tee -a "$OUT/cuda_tests.log"
[ -n "${SKIP_BENCH:-}" ] || {
timeout "$T_KERN" python3 -m experiments.bench_kernels --max-mib ${MAX_MIB:-256} >"$OUT/bench_kernels.log" 2>&1; echo "bench_kernels rc=$?" >>"$OUT/bench_kernels.log"
timeout "$T_GPU" python3 -m experiments.bench_gpu --steps 10 --warmup 3 >"$OUT/bench_gpu.log" 2>&1; echo "bench_gpu rc=$?" >>"$OUT/bench_gpu.log"
}
if python3 -c "import zeropp.doctor" 2>/dev/null; then timeout 120 python3 -m zeropp.doctor >"$OUT/doctor.log" 2>&1; echo "doctor rc=$?" >>"$OUT/doctor.log"; fi
echo "==== summary"; grep -E "passed|failed|error|rc=" "$OUT/cuda_tests.log" | tail -15
for f in bench_kernels bench_gpu doctor; do [ -f "$OUT/$f.log" ] && { echo "== $f"; tail -25 "$OUT/$f.log"; }; done
