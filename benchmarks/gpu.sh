#!/usr/bin/env bash
# What a lent GPU runs, in one call of at most 8 minutes (issue 60): the CUDA tests, then the benchmark
# cases that need a GPU, into one results file, all under $OUT (or benchmarks/results).
#
#   benchmarks/gpu.sh fetch            # here, once, with the registry: the app's pure-Python wheels -> .whl/
#   benchmarks/gpu.sh                  # there, from the checkout: tests, then benchmarks (device tool:
#                                      #   carry [".whl"], timeout_s 560)
#   DEVICE=cpu QUICK=1 benchmarks/gpu.sh   # the script itself checked on a CPU (seconds, nothing on CUDA)
#
# The device machine is bare (Python 3.12, torch, torchvision, timm, transformers, pytest, no Hydra): the app's
# CUDA tests need hydra-core, omegaconf and antlr4 (an sdist only: built here into a wheel), carried in .whl.
# Each part has its own time limit, so a slow part cannot eat the next; the benchmark run stops starting
# cases once its --budget is spent (what it skipped is named in the results) and keeps what ran (its
# .partial.json) if the limit cuts it. Results: $OUT/cuda-<gpu>-<date>-gpu.{json,md}, the tests' log and
# junit file beside them; commit them under benchmarks/results/.
set -u
cd "$(dirname "$0")/.."

if [ "${1:-}" = fetch ]; then
    echo /.whl/ >> .git/info/exclude
    exec python3 -m pip wheel --no-deps -q -w .whl hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3
fi

OUT=${OUT:-benchmarks/results}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
start=$(date +%s)
say() { echo "[gpu.sh $(( $(date +%s) - start ))s] $*"; }

if [ "$DEVICE" = cuda ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
fi

# 1. The CUDA tests (they skip without a GPU) and the device-noise tests, in one process (no xdist).
say "tests"
# No -x: one call must show every failure; the whole log comes back, its end is printed.
timeout 170 python3 -m pytest -q -o addopts="" -p no:cacheprovider -rfEs \
    --junitxml="$OUT/cuda-tests.xml" tests/e2e/test_cuda.py tests/unit/test_nfm.py 2>&1 \
    | tee "$OUT/cuda-tests.log" | tail -n 40

# 2. The benchmark cases that need a GPU, device time included (always on CUDA): eager (channels-last, b100,
# ResNet-50), compiled and bf16 against the hand-edited forward; the peers (timm's Mixup, torchvision's);
# every method against Manifold Mixup; the blend's bandwidth; the host cost.
say "benchmarks"
quick=${QUICK:+--quick}
timeout 300 python3 benchmarks/run.py --device "$DEVICE" $quick --reps 7 --budget 270 --suffix gpu \
    --cases eager,compiled,bf16,peers,methods,blend,host --out "$OUT" 2>&1 | grep -v '^USDT' | tail -n 120
say "done"
