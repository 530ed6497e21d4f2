#!/usr/bin/env bash
# Set up ./.venv and run the whole test suite. Extra arguments go to pytest (e.g. -k cluster, -x, -m "not slow").
# Two parts, one after the other: the tests that may share the machine on two pytest-xdist workers at once (a test
# file stays on one worker), then the tests marked `timing` or `outcome` alone, one at a time (their deadlines and
# measured bounds assume nothing else runs beside them).
# DPWA_TEST_WORKERS sets the workers of the first part (default 2; 0: no workers, everything in one process).
# scripts/test.sh --stress N [PYTEST ARGS]: run the tests marked `timing` (or PYTEST ARGS) N times, each run in a
# fresh pytest process, and print how often each test failed (scripts/stress.py).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup-env.sh "test,plot,tensorboard,lightning,hf"
# pytest caches its rewritten test modules as bytecode; without the cache every pytest process (each worker, each
# part) rewrites and compiles all of them again, ~15 s of CPU
unset PYTHONDONTWRITEBYTECODE
if [ "${1:-}" = "--stress" ]; then
  [ $# -ge 2 ] || { echo "usage: scripts/test.sh --stress N [PYTEST ARGS]" >&2; exit 2; }
  shift
  exec python scripts/stress.py "$@"
fi
workers="${DPWA_TEST_WORKERS:-2}"
parallel=0
python -m pytest -n "$workers" --dist loadfile --part parallel "$@" || parallel=$?
serial=0
python -m pytest --part serial "$@" || serial=$?
# exit 5: that part collected no test (the selection lies wholly in the other part): a failure only if both did
if [ "$parallel" -eq 5 ] && [ "$serial" -eq 5 ]; then exit 5; fi
for rc in "$parallel" "$serial"; do
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then exit "$rc"; fi
done
exit 0
