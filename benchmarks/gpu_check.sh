#!/usr/bin/env bash
# GPU check on one CUDA device, from a plain checkout, with no network (see benchmarks/gpu_check.py).
# The machine's own python3, torch and transformers are used: the checkout is installed with --no-deps
# into a folder put on PYTHONPATH, beside the wheels in .whl/ when that folder exists (for a machine
# without network that lacks one of pdserve's pure dependencies, e.g. isal: `pip download --no-deps
# --only-binary=:all: -d .whl isal` elsewhere). Stops by itself within 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
site="${PDSERVE_GPU_SITE:-/tmp/pdserve-gpu-site}"
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .whl/*.whl; fi
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target "$site" .
check="$PWD/benchmarks/gpu_check.py"
cd /tmp && PYTHONPATH="$site" PYTHONUNBUFFERED=1 exec timeout 470 python3 "$check" "$@"
