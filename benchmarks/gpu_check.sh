#!/usr/bin/env bash
# GPU check on one CUDA device, from a plain checkout, with no network (see benchmarks/gpu_check.py).
# The machine's own torch/transformers are used: a virtualenv with --system-site-packages gets the
# checkout installed with --no-deps. Stops by itself within 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${PDSERVE_GPU_VENV:-/tmp/pdserve-gpu-venv}"
[ -x "$venv/bin/python" ] || python3 -m venv --system-site-packages "$venv"
"$venv/bin/python" -m pip install -q --no-deps --no-build-isolation . 
cd /tmp && exec timeout 470 "$venv/bin/python" "$OLDPWD/benchmarks/gpu_check.py" "$@"
