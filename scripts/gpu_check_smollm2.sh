#!/usr/bin/env bash
# The prepared GPU check of the SmolLM2 learner (issue 41): on a bare GPU machine with no
# network, the learner's seconds per update in each layout (bench/learner_step.py on CUDA), then
# a short configs/smollm2-gpu.yaml run (transformers actors: the lent machine has no vLLM),
# numbers to $OUT/gpu_check_smollm2.json (default OUT=/tmp/gpu-check).
#
# A call to the GPU machine carries at most 64 MiB and SmolLM2's GGUF is 94 MiB, so the model
# travels in two calls that leave its halves in /tmp/gpu-stash:
#
#   bash scripts/gpu_check_smollm2.sh --prepare   here (with network): wheels into .gpu/whl
#                                                 (scripts/gpu_check.sh --prepare), the GGUF's
#                                                 halves and digest into .gpu/smollm2-a|b
#   call 1, carrying .gpu/smollm2-a:   bash scripts/gpu_check_smollm2.sh --stash
#   call 2, carrying .gpu/whl and .gpu/smollm2-b:   bash scripts/gpu_check_smollm2.sh
#   (or, as call 2, `... --layout-cuda`: bench/layout_cuda.py, why shared prefixes are slow on
#   a GPU, to $OUT/layout_cuda.json)
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
stash=/tmp/gpu-stash
case "${1:-}" in
    --prepare)
        bash scripts/gpu_check.sh --prepare
        # transformers reads a GGUF through gguf, which the GPU image lacks
        .venv/bin/python -m pip download -q --only-binary=:all: --no-deps --dest .gpu/whl \
            gguf==0.19.0
        gguf="$(.venv/bin/python -c 'from inference.models import named_gguf; print(named_gguf("smollm2-135m"))')"
        mkdir -p .gpu/smollm2-a .gpu/smollm2-b
        half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
        head -c "$half" "$gguf" > .gpu/smollm2-a/part
        tail -c +"$((half + 1))" "$gguf" > .gpu/smollm2-b/part
        sha256sum "$gguf" | cut -d' ' -f1 > .gpu/smollm2-b/sha256
        exit ;;
    --stash)
        mkdir -p "$stash" && cp .gpu/smollm2-a/part "$stash/part-a" && ls -l "$stash"
        exit ;;
esac

OUT="${OUT:-/tmp/gpu-check}"
mkdir -p "$OUT" /tmp/models
pip install -q --no-index --no-deps --target /tmp/site .gpu/whl/*.whl 2>&1 | tail -2
export PYTHONPATH="/tmp/site:$root" AUTODIDACT_MODELS=/tmp/models
cat "$stash/part-a" .gpu/smollm2-b/part > /tmp/smollm2.gguf
if [[ "$(sha256sum /tmp/smollm2.gguf | cut -d' ' -f1)" != "$(cat .gpu/smollm2-b/sha256)" ]]; then
    echo "the joined GGUF does not match its digest: run call 1 (--stash) first" >&2; exit 1
fi
python3 -m autodidact model convert /tmp/smollm2.gguf --out /tmp/smollm2 > "$OUT/convert.txt" 2>&1 \
    || { tail -5 "$OUT/convert.txt"; exit 1; }

if [[ "${1:-}" == --layout-cuda ]]; then  # a second look: why shared prefixes are slow here
    timeout 400 python3 -m bench.layout_cuda --set model.path=/tmp/smollm2 \
        --json "$OUT/layout_cuda.json"
    exit
fi

t0=$(date +%s)
# Each stage has its own time limit, so the json below is written inside one 600 s call.
timeout 180 python3 -m bench.learner_step --config configs/smollm2-gpu.yaml --set model.path=/tmp/smollm2 \
    --threads 4 --repeats 5 \
    --json "$OUT/learner_step_cuda.json" --note "GPU check (scripts/gpu_check_smollm2.sh)" \
    > "$OUT/learner_step.txt" 2>&1
echo "learner_step rc $?"; tail -12 "$OUT/learner_step.txt"
t1=$(date +%s)
timeout 330 python3 -m autodidact run -c configs/smollm2-gpu.yaml --set model.path=/tmp/smollm2 \
    --set actor.backend=transformers --set tracking.wandb=disabled \
    --set experience.enabled=false --set learner.max_minutes=3 --set eval.num_tasks=20 \
    --run-dir /tmp/gpu-smollm2 > "$OUT/run.txt" 2>&1
echo "run rc $?"; tail -8 "$OUT/run.txt"
t2=$(date +%s)
LEARNER_STEP_S=$((t1 - t0)) RUN_S=$((t2 - t1)) python3 - "$OUT" <<'PY'
import json, os, subprocess, sys

import torch
import transformers

out = sys.argv[1]
def read(path):
    return json.load(open(path)) if os.path.exists(path) else {}
metrics = [json.loads(line) for line in open("/tmp/gpu-smollm2/metrics.jsonl")] \
    if os.path.exists("/tmp/gpu-smollm2/metrics.jsonl") else []
learner = [m for m in metrics if m.get("role") == "learner" and "learner/updates" in m]
result = {
    "command": "bash scripts/gpu_check_smollm2.sh (after --prepare here, and --stash in a "
               "call before)",
    "device": subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True).stdout.strip(),
    "torch": torch.__version__, "transformers": transformers.__version__,
    "python": sys.version.split()[0],
    "learner_step": read(f"{out}/learner_step_cuda.json"),
    "learner_step_s": int(os.environ["LEARNER_STEP_S"]), "run_s": int(os.environ["RUN_S"]),
    "run_summary": read("/tmp/gpu-smollm2/summary.json"),
    "run_updates": learner[-1]["learner/updates"] if learner else 0,
    "run_learner_last": learner[-1] if learner else {},
}
with open(f"{out}/gpu_check_smollm2.json", "w") as f:
    json.dump(result, f, indent=1, default=str)
PY
