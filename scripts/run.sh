#!/usr/bin/env bash
# The main job on embedded defaults: set up (once), then `autodidact run` with any extra arguments.
exec bash "$(dirname "${BASH_SOURCE[0]}")/autodidact.sh" run "$@"
