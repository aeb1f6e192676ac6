#!/usr/bin/env bash
# The wheels a GPU machine without network needs beside its own packages, downloaded here into
# bench/gpu/wheels (kept out of git; about 12 MB). The machine this check was written for has
# Python 3.12 with torch 2.11 (CUDA), transformers 5.17, accelerate, peft, safetensors, numpy,
# pandas, pyarrow, pytest and pytest-xdist, and lacks the packages below (issue 52 listed them).
#
#   bash bench/gpu/wheels.sh                  # for the GPU machine: CPython 3.12, manylinux x86_64
#   PYV=3.11 WHEELS=/tmp/w bash bench/gpu/wheels.sh   # for a rehearsal on this machine's Python
#
# Each package pinned to the version constraints.txt holds (the suite passed with those), with
# --no-deps: the list is closed by hand, and bench/gpu/check.sh installs it with --no-deps too.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYV=${PYV:-3.12}
WHEELS=${WHEELS:-bench/gpu/wheels}
PACKAGES=(
    # tandem's own dependencies the machine lacks, and theirs
    fastapi starlette pydantic pydantic_core typing-inspection annotated-types opentelemetry-api uvicorn
    datasets dill multiprocess zstandard math-verify latex2sympy2_extended antlr4-python3-runtime
    # newer than the machine may hold: pydantic needs typing_extensions>=4.16, datasets fsspec<=2026.9.0
    typing_extensions fsspec
)
pins=()
for name in "${PACKAGES[@]}"; do
    pin=$(grep -i -E "^${name//[-_]/[-_]}==" constraints.txt) || { echo "wheels.sh: $name is not in constraints.txt" >&2; exit 1; }
    pins+=("$pin")
done
pins+=(trl==1.16.0)  # TRL's GRPOTrainer, the baseline of bench/scale.py (not in constraints.txt: bench/vs_trl.py's own venv pins it)
rm -rf "$WHEELS"
mkdir -p "$WHEELS"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$WHEELS" "${pins[@]}"
ls "$WHEELS"
du -sh "$WHEELS"
