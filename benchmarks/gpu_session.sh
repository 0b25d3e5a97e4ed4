#!/usr/bin/env bash
# Everything this project measures on a GPU, in one call of about 9 minutes on an H200: the tests
# that run only on CUDA, benchmarks/gpu.py (checks, GPT-2 124M bench with kernel tables and
# peak-memory breakdowns) and benchmarks/offload.py at the size where offload can pay.
#
# For a machine whose python3 has torch but not tensordict or torchdata (the lent GPUs so far:
# torch 2.11.0+cu130). Prepare, once, on a machine with pip (the wheels are git-ignored):
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl tensordict==0.15.3 torchdata==0.11.0 pyvers==0.2.3
#
# then run from the checkout's root there, with $OUT the folder that comes back:
#
#   OUT=/tmp/out bash benchmarks/gpu_session.sh
#
# Each part has its own time limit and writes its log to $OUT as it goes, so a part that hangs
# or fails leaves the others' results.
set -uo pipefail
OUT=${OUT:?set OUT to the folder that collects the logs}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, tensordict, torchdata; print(torch.__version__, tensordict.__version__, torchdata.__version__)" | tee -a "$OUT/gpu.txt"

timeout 120 python3 -m pytest -q -p no:cacheprovider tests/transforms/test_offload.py \
    tests/app/recipes/test_placement.py tests/test_losses.py tests/data/test_pipeline.py \
    2>&1 | tee "$OUT/tests.log"
timeout 330 python3 benchmarks/gpu.py --apart --dump "$OUT" --results "$OUT/RESULTS.md" \
    2>&1 | tee "$OUT/gpu.log"
timeout 90 python3 benchmarks/offload.py --device cuda --large --threads 16 --rounds 10 \
    --profile "$OUT" 2>&1 | tee "$OUT/offload.log"
