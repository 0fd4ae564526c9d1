#!/usr/bin/env bash
# Any `autodidact` command after set-up (once): `bash scripts/autodidact.sh status --watch 5`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
venv="${AUTODIDACT_VENV:-$root/.venv}"
cd "$root"
exec "$venv/bin/autodidact" "$@"
