#!/usr/bin/env bash
# Set up ./.venv and run the whole test suite. Extra arguments go to pytest (e.g. -k cluster, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup-env.sh "test,plot"
python -m pytest "$@"
