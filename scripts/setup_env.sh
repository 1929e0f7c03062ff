#!/usr/bin/env bash
# Creates .venv with the torchrec_cnr stack.
#
#   bash scripts/setup_env.sh            # CPU flavour, or CUDA where nvidia-smi finds a GPU
#   CNR_FLAVOUR=cpu bash scripts/setup_env.sh
#
# torchrec declares a dependency on the CUDA build of fbgemm-gpu, so it is
# installed with --no-deps and its small dependencies are listed here.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3

flavour=${CNR_FLAVOUR:-}
if [ -z "$flavour" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    flavour=cuda
  else
    flavour=cpu
  fi
fi

# The C sources are in the stamp: a change rebuilds the compiled libraries.
stamp="$VENV/.cnr-$flavour-$(sha1sum pyproject.toml setup.py scripts/setup_env.sh torchrec_cnr/*.c torchrec_cnr/*/*.c | sha1sum | cut -c1-12)"
if [ -f "$stamp" ]; then
  exit 0
fi

echo "setup_env: creating $VENV ($flavour flavour)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip="$VENV/bin/python -m pip --disable-pip-version-check -q"
$pip install torch==2.13.0
if [ "$flavour" = cuda ]; then
  $pip install fbgemm-gpu==1.8.0
else
  $pip install fbgemm-gpu-cpu==1.8.0
fi
$pip install --no-deps torchrec==1.8.0
$pip install tensordict "torchmetrics==1.0.3" tqdm pyre-extensions iopath
$pip install -e ".[dev]"
# Azurite, Azure Storage's local server, for the az:// tests (where npm is).
if command -v npm >/dev/null 2>&1; then
  npm install --prefix "$VENV/azurite" --no-audit --no-fund --silent azurite@3.37.0
fi
rm -f "$VENV"/.cnr-*
touch "$stamp"
echo "setup_env: ready"
