#!/usr/bin/env bash
# The main job: set up ./.venv (the CPU build of torch and dpwa, editable) and run the built-in demo on the
# four local nodes of samples/localhost.yaml. Each node gossip-trains a small classifier on its own shard of
# generated data; the summary prints the averaged model's accuracy next to a one-process baseline's.
# Extra arguments go to `dpwa run`, e.g. scripts/demo.sh --steps 1000 --run-dir runs/demo
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source scripts/setup-env.sh ""
exec dpwa run samples/localhost.yaml "$@"
