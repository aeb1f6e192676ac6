#!/usr/bin/env bash
# tandem's GPU check in one command, on a machine with one CUDA GPU and no network:
#
#   bash bench/gpu/wheels.sh     # here, with network: what the GPU machine lacks, into bench/gpu/wheels
#   bash bench/gpu/check.sh      # there, from the repository's root, bench/gpu/wheels beside it
#
# Steps, each under a time limit, each one's output in a log of its own under $TANDEM_GPU_OUT
# (default bench/gpu/out), and summary.md there at the end (and after each step):
#   1. install bench/gpu/wheels into a folder of their own (--no-deps: wheels.sh closed the list);
#   2. the tests marked gpu (tests/test_gpu.py): the chunked output layer, the checkpointed MLP,
#      the decode cache, behaviour log-probs, a colocated run that resumes bitwise, a CUDA IPC push;
#   3. weight pushes of the Qwen2.5-0.5B shape to a bf16 server on the same GPU, by cuda_ipc, shm
#      and http (bench/weight_sync.py), and the GPU memory the server took;
#   4. bench/scale.py at that shape, bf16, 8 x 1,024 tokens: TRL 1.16's GRPOTrainer, tandem
#      colocated and tandem with a server on the same GPU in async mode (each push timed).
#
# TANDEM_GPU_REHEARSE=1 runs the same steps on the CPU at small sizes (the gpu tests with
# TANDEM_TEST_DEVICE=cpu), to find what breaks before GPU time is spent. PYTHON: the interpreter
# (default python3); TANDEM_GPU_WHEELS: the wheel folder.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUT=${TANDEM_GPU_OUT:-bench/gpu/out}
WHEELS=${TANDEM_GPU_WHEELS:-bench/gpu/wheels}
SITE=$(mktemp -d /tmp/tandem-gpu-site.XXXX)
mkdir -p "$OUT"
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ "${TANDEM_GPU_REHEARSE:-0}" = 1 ]; then
    export TANDEM_TEST_DEVICE=cpu
    PUSH=(--size tiny --device cpu --dtype bfloat16 --transports shm http --repeats 2)
    SCALE=(--lengths 8 --steps 2 --bf16 only)
else
    PUSH=(--size 0.5b --device cuda --dtype bfloat16 --transports cuda_ipc shm http --repeats 3)
    SCALE=(--lengths 1024 --steps 3 --bf16 only)
fi
START=$SECONDS
SUMMARY=()

# step NAME LIMIT_S COMMAND...: runs it into $OUT/NAME.log, notes its status and time, rewrites summary.md.
step() {
    local name=$1 limit=$2 start=$SECONDS status
    shift 2
    echo "== $name: $*" | tee "$OUT/$name.log"
    timeout --kill-after=10 "$limit" "$@" >> "$OUT/$name.log" 2>&1
    status=$?
    case $status in
        0) SUMMARY+=("- $name: ok in $((SECONDS - start)) s") ;;
        124 | 137) SUMMARY+=("- $name: STOPPED at its limit of $limit s") ;;
        *) SUMMARY+=("- $name: FAILED (exit $status) in $((SECONDS - start)) s") ;;
    esac
    echo "${SUMMARY[-1]}"
    summarize
}

summarize() {
    {
        echo "# tandem GPU check, $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
        echo
        printf '%s\n' "${SUMMARY[@]}"
        echo "- total: $((SECONDS - START)) s"
        echo
        echo '## Machine'
        echo '```'
        cat "$OUT/env.log" 2>/dev/null
        echo '```'
        echo '## Tests'
        echo '```'
        grep -E "passed|failed|error|skipped" "$OUT/tests.log" 2>/dev/null | tail -3
        grep -E "^(FAILED|ERROR) " "$OUT/tests.log" 2>/dev/null
        echo '```'
        echo '## Weight pushes'
        echo '```'
        sed -n '/^model:/p; /took/p; /a .* server$/,$p' "$OUT/push.log" 2>/dev/null
        echo '```'
        echo '## tandem against TRL'
        echo '```'
        grep -E "matmul roofline|^[0-9]+ (bf16|fp32) [a-z-]+: " "$OUT/scale.log" 2>/dev/null
        sed -n '/^8 x /,$p' "$OUT/scale.log" 2>/dev/null
        echo '```'
    } > "$OUT/summary.md"
}

step install 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl
step env 60 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo 'no GPU'; \
    \"$PY\" -c 'import sys, torch, transformers, accelerate, datasets, fastapi, trl; print(sys.version.split()[0], \"torch\", torch.__version__, \"cuda\", torch.version.cuda, \
\"transformers\", transformers.__version__, \"accelerate\", accelerate.__version__, \"datasets\", datasets.__version__, \"trl\", trl.__version__)'"
step tests 150 "$PY" -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider
step push 120 "$PY" bench/weight_sync.py "${PUSH[@]}"
step scale 360 "$PY" bench/scale.py "${SCALE[@]}" --configs trl colocate server-async --trl-python "$PY"
rm -rf "$SITE"
cat "$OUT/summary.md"
