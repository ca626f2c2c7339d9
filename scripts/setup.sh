#!/usr/bin/env bash
# Creates .venv with Python 3.12 and installs jaxattn with its test extras, pinned by constraints.txt.
#
# STACK=latest bash scripts/setup.sh (or: bash scripts/setup.sh latest) makes a second environment, .venv/latest,
# pinned by constraints-latest.txt instead: the newest jax / triton / jax-triton releases, which CI tests as well.
set -euo pipefail
cd "$(dirname "$0")/.."
stack=${1:-${STACK:-pinned}}
case "$stack" in
  pinned) venv=.venv; constraints=constraints.txt ;;
  latest) venv=.venv/latest; constraints=constraints-latest.txt ;;
  *) echo "setup.sh: unknown stack '$stack' (pinned or latest)" >&2; exit 2 ;;
esac
py=""
for candidate in "${PYTHON:-}" python3.12 "$(pyenv prefix 3.12.1 2>/dev/null)/bin/python"; do
  if [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 \
     && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
    py=$candidate; break
  fi
done
if [ -z "$py" ]; then
  echo "setup.sh: Python 3.12 not found (jax 0.11 needs >= 3.12). Set PYTHON=/path/to/python3.12." >&2
  exit 1
fi
if [ ! -x $venv/bin/python ]; then
  "$py" -m venv $venv
fi
$venv/bin/python -m pip install -q --upgrade pip
$venv/bin/python -m pip install -q -c $constraints -e ".[test]"
# Mosaic GPU kernels lower (not run) on a CPU given jax's CUDA plugin module: tests/test_extend_mgpu.py lowers the
# Hopper extend kernel for sm_90 with it, in a subprocess. Kept out of site-packages, so this environment never tries
# to start a CUDA backend; the test skips when it is missing.
if [ ! -d $venv/mosaic_gpu_lowering/jax_cuda12_plugin ]; then
  $venv/bin/python -m pip install -q --no-deps -c $constraints --target $venv/mosaic_gpu_lowering jax-cuda12-plugin \
    || echo "setup.sh: jax-cuda12-plugin not installed: the Mosaic GPU lowering test will skip" >&2
fi
echo "setup.sh: $venv ready ($($venv/bin/python --version))"
