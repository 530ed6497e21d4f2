#!/usr/bin/env bash
# Run the built-in demo once per mixing rule (same seed and steps, samples/localhost.yaml's ports 45000-45003)
# and write runs/compare-rules/comparison.{md,json,png}: final loss, accuracy, spread between the nodes,
# mixes and bytes per rule. Takes minutes. Sets up ./.venv (with matplotlib) first.
# Arguments go to scripts/compare_rules.py, e.g. scripts/compare_rules.sh --steps 1000 --rules constant,gem,pushsum
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source scripts/setup-env.sh "plot"
exec python scripts/compare_rules.py "$@"
