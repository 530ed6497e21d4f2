#!/usr/bin/env bash
# Sourced by the other scripts: creates ./.venv (once) and installs dpwa with the given extras into it.
# Usage: source scripts/setup-env.sh [EXTRAS]   e.g. "test,plot"
# PYTHON picks the interpreter (default python3); TORCH_SPEC the torch requirement (default the CPU build
# torch==2.13.0; set TORCH_SPEC=torch for the CUDA build).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
extras="${1:-}"
venv="$root/.venv"
if [ ! -x "$venv/bin/python" ]; then
  echo "dpwa: creating virtual environment in $venv" >&2
  "${PYTHON:-python3}" -m venv "$venv"
fi
# shellcheck disable=SC1091
source "$venv/bin/activate"
stamp="$venv/.dpwa-installed"
want="$(cat "$root/setup.cfg" "$root/setup.py" "$root/pyproject.toml" | sha1sum | cut -c1-12) extras=[$extras] torch=${TORCH_SPEC:-torch==2.13.0}"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "dpwa: installing into $venv (extras: ${extras:-none})" >&2
  python -m pip install --quiet --upgrade pip
  python -m pip install --quiet "${TORCH_SPEC:-torch==2.13.0}"
  python -m pip install --quiet -e "$root${extras:+[$extras]}"
  echo "$want" > "$stamp"
fi
# Byte-compile the sources (a no-op when nothing changed): where PYTHONDONTWRITEBYTECODE is set, every process that
# imports dpwa would otherwise compile it from source again, ~0.2 s each, and the test suite starts hundreds.
python -m compileall -q "$root/dpwa" "$root/adapters" "$root/examples" >/dev/null \
  || echo "dpwa: byte-compiling the sources failed (harmless: Python compiles them on import)" >&2
