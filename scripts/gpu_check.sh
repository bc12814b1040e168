#!/usr/bin/env bash
# The CUDA kernels on a GPU machine, in one go: build the extension, run the GPU tests (each op against its
# torch twin, the engine against transformers), run the kernel benchmark. Logs and JSON go to $OUT (./out
# when unset). About 3 to 5 minutes on one H200. Exits non-zero if the build or any test failed.
#
#     bash scripts/gpu_check.sh            # from the repository root, with a python3 that has CUDA torch
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT="${OUT:-./out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"

{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
  command -v nvcc && nvcc --version | tail -n 2 || echo "nvcc: not on PATH"
  "$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
} 2>&1 | tee "$OUT/env.txt"

# Install only what is missing, and only if a package index answers; a machine without one carries on.
missing=$("$PY" - <<'PY'
import importlib.util
need = {"transformers": "transformers", "tokenizers": "tokenizers", "safetensors": "safetensors",
        "accelerate": "accelerate", "numpy": "numpy", "tqdm": "tqdm", "pytest": "pytest",
        "hypothesis": "hypothesis", "ninja": "ninja"}
print(" ".join(pkg for module, pkg in need.items() if importlib.util.find_spec(module) is None))
PY
)
if [ -n "$missing" ]; then
  echo "missing: $missing" | tee -a "$OUT/env.txt"
  "$PY" -m pip install --quiet --timeout 10 --retries 0 $missing 2>&1 | tail -n 3 | tee -a "$OUT/env.txt" \
    || echo "pip could not install them; carrying on" | tee -a "$OUT/env.txt"
fi

status=0
"$PY" -m kernels.build 2>&1 | tee "$OUT/build.log" || status=1
if [ "$status" -eq 0 ]; then
  "$PY" -m pytest -q -m gpu -p no:cacheprovider --durations=10 tests/kernels/test_kernels_cuda.py 2>&1 \
    | tee "$OUT/pytest.log" || status=1
  "$PY" benchmarks/kernel_bench.py --json "$OUT/kernel_bench.json" 2>&1 | tee "$OUT/bench.log" || status=1
fi
echo "gpu_check: $([ "$status" -eq 0 ] && echo passed || echo FAILED); logs in $OUT" | tee -a "$OUT/env.txt"
exit "$status"
