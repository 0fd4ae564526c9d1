#!/usr/bin/env bash
# The whole test suite: set up (once), then pytest with any extra arguments in two tiers: the
# main virtualenv's tests (all but those marked `vllm`) on AUTODIDACT_TEST_WORKERS pytest-xdist
# workers (default 4; 0: in one process), and the tests marked `vllm` in the engine's virtualenv
# (the real vLLM engine, one engine thread; see scripts/setup.sh for why it has its own
# virtualenv), whose output follows the main tier's. Fails if either fails.
#
# The vLLM tier runs beside the main tier on a machine of 4 cores or more, after it on a smaller
# one (AUTODIDACT_VLLM_BESIDE=1 or 0 decides): beside four workers on 2 cores, a served SmolLM2
# took past its 240 s request deadline and a whole vLLM run past its 560 s (CI at dddd987).
#
# Whole modules go to one worker (--dist loadfile): their module-scoped runs are made once; the
# modules that start whole runs form three chains, each on one worker, the fourth worker takes
# the rest (tests/conftest.py: WHOLE_RUNS).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
venv="${AUTODIDACT_VENV:-$root/.venv}"
vllm_venv="${AUTODIDACT_VLLM_VENV:-$root/.venv-vllm}"
workers="${AUTODIDACT_TEST_WORKERS:-4}"
cd "$root"

vllm_pid="" vllm_log=""
stop_vllm() {  # the main tier was interrupted: SIGINT lets pytest tear down its engines
    if [[ -n "$vllm_pid" ]]; then
        kill -INT "$vllm_pid" 2>/dev/null || true
        for _ in $(seq 60); do kill -0 "$vllm_pid" 2>/dev/null && sleep 1; done
        kill -TERM "$vllm_pid" 2>/dev/null || true
        wait "$vllm_pid" 2>/dev/null || true
    fi
    vllm_pid=""
}
trap 'stop_vllm; [[ -z "$vllm_log" ]] || rm -f "$vllm_log"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
beside="${AUTODIDACT_VLLM_BESIDE:-$(( $(nproc) >= 4 ))}"
vllm_tier=0
[[ -x "$vllm_venv/bin/python" && "${AUTODIDACT_SKIP_VLLM:-0}" != 1 ]] && vllm_tier=1
if [[ $vllm_tier == 1 && $beside == 1 ]]; then
    vllm_log="$(mktemp "${TMPDIR:-/tmp}/autodidact-vllm-tier.XXXXXX")"
    # Job control on for the launch only: a background job of a script otherwise ignores SIGINT
    # (so pytest could not be stopped cleanly); its own process group, so it is stopped above.
    set -m
    "$vllm_venv/bin/python" -m pytest -m vllm "$@" >"$vllm_log" 2>&1 &
    vllm_pid=$!
    set +m
fi

status=0
parallel=()
[[ "$workers" == 0 ]] || parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
"$venv/bin/python" -m pytest -m "not vllm" "${parallel[@]}" "$@" || status=$?
[[ $status != 2 ]] || stop_vllm  # interrupted (or a usage error, which the other tier shares)

if [[ -n "$vllm_pid" ]]; then
    rc=0
    wait "$vllm_pid" || rc=$?
    vllm_pid=""
    echo "[test] the real vLLM engine, in $vllm_venv (run beside the tier above)" >&2
    cat "$vllm_log"
    [[ $rc == 5 ]] && rc=0  # the arguments selected no engine test
    [[ $status == 0 ]] && status=$rc
elif [[ $vllm_tier == 1 && $beside != 1 && $status != 2 ]]; then
    echo "[test] the real vLLM engine, in $vllm_venv (after the tier above)" >&2
    rc=0
    "$vllm_venv/bin/python" -m pytest -m vllm "$@" || rc=$?
    [[ $rc == 5 ]] && rc=0
    [[ $status == 0 ]] && status=$rc
fi
exit "$status"
