#!/usr/bin/env bash
# The GPU acceptance in one command, on one CUDA machine, in under 10 minutes, most needed first:
#   python -m zeropp.doctor (its JSON report: $OUT/doctor.json), the streams and runtime tests (alone),
#   the cuda modules not yet fully proven on a GPU, python -m experiments.bench_gpu (two interleaved rounds), the kernel and
#   runner modules (in parallel when pytest-xdist is installed), python -m experiments.bench_kernels and
#   the host cost of one kernel launch (scripts/gpu_probe_host.py).
# Writes one markdown report: device, driver, torch / CUDA / NCCL / Triton versions, date, the
# test outcome and the benchmark tables; the full logs go next to it.
#
#   bash scripts/gpu_check.sh [REPORT]      (default: $OUT/gpu_check.md, OUT=gpu-check-out)
#
# Without a CUDA device it prints one line saying why and exits 0, writing nothing (a PYTHON that
# cannot import torch is an error, exit 1). Exit status
# otherwise: 0 when every part passed, 1 when one failed or ran out of time (the report says which).
# Environment: PYTHON (default python3); OUT; GPU_CHECK_BUDGET_S (default 570, the whole check's
# seconds; each part also has its own cap); XDIST (workers of the parallel pass, default: the cores less 2, 2 to 14);
# PYTEST_ARGS (added to both test passes). Wheels the machine lacks (hydra-core, omegaconf,
# antlr4) can be put in .whl/: they are installed into a temporary folder, offline.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}

# ---- no GPU: one line, exit 0, nothing written (a Python without torch is an error: exit 1)
reason=$("$PY" -c '
import sys
try:
    import torch
except Exception as e:
    print(f"gpu_check: error: {sys.executable} cannot import torch ({type(e).__name__}: {e}); set PYTHON")
    sys.exit(3)
if not torch.cuda.is_available():
    print(f"no CUDA device visible to torch {torch.__version__} (torch.cuda.is_available() is False)")
') || { echo "${reason:-gpu_check: error: $PY cannot be run; set PYTHON to the Python with torch}" >&2; exit 1; }
if [ -n "$reason" ]; then
  echo "gpu_check: skipped: $reason"
  exit 0
fi

OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT" || exit 1
REPORT=${1:-$OUT/gpu_check.md}
DEADLINE=$((SECONDS + ${GPU_CHECK_BUDGET_S:-570}))
export PYTHONUNBUFFERED=1 WANDB_MODE=offline WANDB_SILENT=true
unset TRITON_INTERPRET  # the compiled kernels, never the interpreter (tests/conftest.py does the same)

# ---- the packages the image lacks, and this checkout importable as zeropp
if ls .whl/*.whl >/dev/null 2>&1; then
  site=$(mktemp -d)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl \
    >"$OUT/install.log" 2>&1 || { echo "gpu_check: installing .whl/ failed, see $OUT/install.log"; exit 1; }
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
fi
here=$(pwd -P)
# zeropp.kernels and zeropp.experiments live in kernels/ and experiments/: only an (editable) install maps them,
# so a bare checkout on sys.path imports zeropp but not its kernels.
if ! "$PY" -c "import sys, zeropp.kernels as k; sys.exit(not k.__file__.startswith('$here/kernels/'))" 2>/dev/null; then
  "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$OUT/install.log" 2>&1 \
    || { echo "gpu_check: installing this checkout failed, see $OUT/install.log"; exit 1; }
fi

# ---- one part: run it under the smaller of its cap and the time left; record its status
failed=()
run_part() {  # name cap command...
  local name=$1 cap=$2 left rc
  shift 2
  left=$((DEADLINE - SECONDS))
  if [ "$left" -le 5 ]; then
    echo "not run: the check's time budget is spent" >"$OUT/$name.log"
    failed+=("$name (not run: out of time)")
    return
  fi
  [ "$cap" -gt "$left" ] && cap=$left
  timeout -s INT -k 20 "$cap" "$@" >"$OUT/$name.log" 2>&1  # SIGINT: pytest still prints its summary
  rc=$?
  echo "$name: rc=$rc (${cap}s cap)" >>"$OUT/parts.txt"
  if [ "$rc" -eq 124 ]; then failed+=("$name (timed out after ${cap}s)")
  elif [ "$rc" -ne 0 ]; then failed+=("$name (exit $rc)"); fi
}
has() { "$PY" -c "import $1" 2>/dev/null; }

: >"$OUT/parts.txt"
# The parts run in the order of what most needs a GPU's verdict, so a check cut by the device's time
# still answers that: the doctor (versions, kernels bit-exact, worlds; seconds), the streams modules
# (ALONE_FIRST), the runtime, NCCL-world and doctor tests (alone: each starts worlds of its own, and
# their host-read and stall timings want the GPU to themselves; none of their runtime modules has
# finished on a GPU since the engine's local copies and control exchanges went in, and together they
# are estimated at about two minutes, more than the 120 s cap they had), the float formats' modules (FIRST_MODULES: most of their cases passed on an
# H100), the training benchmark, the modules that have passed on GPUs
# before (the kernels and the runner's jobs, in parallel), then the kernel benchmark. Independent one-process modules (kernels, and the
# runner's jobs, each a world of its own) run on xdist workers, each with its share of the cores'
# threads (tests/conftest.py). On a 16-core H100 host (2026-11-26) the first modules and the parallel
# ones were still cut by their caps (287 and 179 cases passed) while each worker ran torch's 16 threads:
# the CPU references of the large cases took 45-105 s each, oversubscribed. A part cut by its cap gets
# SIGINT, on which pytest still prints what passed and failed so far.
FIRST_MODULES=(tests/gpu/test_kernels_formats_cuda.py tests/gpu/test_comm_format_reductions_cuda.py)
# also not yet proven, and run alone: side streams and allocator reuse; stage 3's local copies at world 1
ALONE_FIRST=(tests/gpu/test_comm_streams_cuda.py tests/gpu/test_runtime_local_group_cuda.py)
PARALLEL_MODULES=(tests/gpu/test_kernels_cuda.py tests/gpu/test_kernels_hadamard_cuda.py
  tests/gpu/test_comm_zero_copy.py tests/gpu/test_experiments_cuda.py)
pytest_opts=(-m cuda -q -rfEs -p no:cacheprovider)
has pytest_timeout && pytest_opts+=(--timeout=150)
workers=$(($(nproc) - 2)); [ "$workers" -lt 2 ] && workers=2; [ "$workers" -gt 14 ] && workers=14
xdist=()
has xdist && xdist=(-n "${XDIST:-$workers}")
ignores=()
for m in "${FIRST_MODULES[@]}" "${ALONE_FIRST[@]}" "${PARALLEL_MODULES[@]}"; do ignores+=(--ignore="$m"); done
run_part doctor 60 "$PY" -m zeropp.doctor --json "$OUT/doctor.json"
run_part cuda_streams 90 "$PY" -m pytest "${pytest_opts[@]}" "${ALONE_FIRST[@]}"
# shellcheck disable=SC2086  # PYTEST_ARGS is a list of words
run_part cuda_tests 200 "$PY" -m pytest "${pytest_opts[@]}" --durations=10 "${ignores[@]}" ${PYTEST_ARGS:-}
# shellcheck disable=SC2086
run_part cuda_first 150 "$PY" -m pytest "${pytest_opts[@]}" --durations=10 "${xdist[@]}" "${FIRST_MODULES[@]}" ${PYTEST_ARGS:-}
# two interleaved rounds: one run per row could not rank two rows a few percent apart (docs/benchmarks.md)
run_part bench_gpu 150 "$PY" -m experiments.bench_gpu --jobs stage0,stage3,fsdp2 --steps 10 --warmup 3 --rounds 2
# shellcheck disable=SC2086
run_part cuda_parallel 200 "$PY" -m pytest "${pytest_opts[@]}" --durations=10 "${xdist[@]}" "${PARALLEL_MODULES[@]}" ${PYTEST_ARGS:-}
run_part bench_kernels 60 "$PY" -m experiments.bench_kernels --min-kib 65536 --max-mib 256  # rows stream
run_part probe_host 30 "$PY" scripts/gpu_probe_host.py

# ---- the report
tests_line() { grep -E "([0-9]+ (passed|failed|error|errors|skipped))|no tests ran" "$OUT/$1.log" | tail -1; }
{
  echo "# GPU check"
  echo
  echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "- device (name, memory, driver): $(nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv,noheader 2>/dev/null | head -1); $(nvidia-smi -L 2>/dev/null | wc -l) visible"
  "$PY" -c '
import os, sys, torch, triton
v = torch.cuda.nccl.version()
nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "unset")
print(f"- python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}, NCCL {nccl}), "
      f"Triton {triton.__version__}; CUDA allocator {torch.cuda.get_allocator_backend()} "
      f"(PYTORCH_CUDA_ALLOC_CONF={conf})")' 2>&1
  echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (with local changes)')"
  echo "- verdict: $([ ${#failed[@]} -eq 0 ] && echo "every part passed" || echo "FAILED: ${failed[*]}")"
  echo "- total: ${SECONDS}s; logs in $OUT/"
  echo
  echo "## Tests (pytest -m cuda)"
  echo
  for part in cuda_first cuda_streams cuda_parallel cuda_tests; do
    echo "- $part: $(tests_line "$part" || echo "no summary, see $OUT/$part.log")"
  done
  grep -hE "^(FAILED|ERROR) " "$OUT"/cuda_{first,streams,parallel,tests}.log 2>/dev/null |
    cut -c1-300 | sed 's/^/  - /'
  for part in bench_kernels bench_gpu; do
    echo
    echo "## $part"
    echo
    cat "$OUT/$part.log"
  done
  for part in probe_host doctor; do
    [ -f "$OUT/$part.log" ] || continue
    printf '\n## %s\n\n```\n' "$part"
    cat "$OUT/$part.log"
    printf '```\n'
  done
} >"$REPORT"
echo "gpu_check: $([ ${#failed[@]} -eq 0 ] && echo passed || echo "FAILED: ${failed[*]}"); report: $REPORT"
[ ${#failed[@]} -eq 0 ]
