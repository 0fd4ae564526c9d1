#!/usr/bin/env bash
# The whole test suite: set up (once), then pytest with any extra arguments.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
venv="${AUTODIDACT_VENV:-$root/.venv}"
cd "$root"
exec "$venv/bin/python" -m pytest "$@"
