#!/usr/bin/env bash
# The whole test suite: set up (once), then pytest with any extra arguments: first in the main
# virtualenv, then the tests marked `vllm` in the engine's virtualenv (the real vLLM engine; see
# scripts/setup.sh for why it has its own). Fails if either fails.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
venv="${AUTODIDACT_VENV:-$root/.venv}"
vllm_venv="${AUTODIDACT_VLLM_VENV:-$root/.venv-vllm}"
cd "$root"
status=0
"$venv/bin/python" -m pytest -m "not vllm" "$@" || status=$?
if [[ -x "$vllm_venv/bin/python" && "${AUTODIDACT_SKIP_VLLM:-0}" != 1 ]]; then
    echo "[test] the real vLLM engine, in $vllm_venv" >&2
    rc=0
    "$vllm_venv/bin/python" -m pytest -m vllm "$@" || rc=$?
    [[ $rc == 5 ]] && rc=0  # the arguments selected no engine test
    [[ $status == 0 ]] && status=$rc
fi
exit "$status"
