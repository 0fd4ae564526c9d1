#!/usr/bin/env bash
# The main job on embedded defaults: set up (once), then `autodidact run` with any extra arguments.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
venv="${AUTODIDACT_VENV:-$root/.venv}"
cd "$root"
exec "$venv/bin/autodidact" run "$@"
