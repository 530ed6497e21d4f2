#!/usr/bin/env bash
# Set up ./.venv and run the whole test suite. Extra arguments go to pytest (e.g. -k cluster, -x, -m "not slow").
# scripts/test.sh --stress N [PYTEST ARGS]: run the tests marked `timing` (or PYTEST ARGS) N times, each run in a
# fresh pytest process, and print how often each test failed (scripts/stress.py).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup-env.sh "test,plot,tensorboard,lightning,hf"
if [ "${1:-}" = "--stress" ]; then
  [ $# -ge 2 ] || { echo "usage: scripts/test.sh --stress N [PYTEST ARGS]" >&2; exit 2; }
  shift
  exec python scripts/stress.py "$@"
fi
python -m pytest "$@"
