# Sourced by the GPU scripts on a lent CUDA machine: $OUT for logs, the wheels the image lacks
# (hydra-core, omegaconf, antlr4 in .whl/) on PYTHONPATH, and this checkout installed editable.
OUT=${OUT:-gpu-proof-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 WANDB_MODE=offline WANDB_SILENT=true
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
