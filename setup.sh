#!/usr/bin/env bash
# Creates .venv with tandem and its test dependencies, CPU build of torch.
# Users with GPUs: install the torch build for your CUDA first, then `pip install -e .`.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
"$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first, pinned: an open range would pull a multi-GB CUDA build on a CPU machine.
python -m pip install -q torch==2.13.0
python -m pip install -q -c constraints.txt -e ".[test]"
echo "ready: . .venv/bin/activate && tandem demo"
