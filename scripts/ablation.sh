#!/usr/bin/env bash
# The ablation table (docs/results/ablation.md): set up (once), then `autodidact ablation` with any extra
# arguments. No arguments: 3 seeds x 4 trained arms, about an hour on 2 cores; --quick: 1 seed in
# under 10 minutes. Runs go to runs/ablation; finished runs are reused when run again.
exec bash "$(dirname "${BASH_SOURCE[0]}")/autodidact.sh" ablation "$@"
