#!/usr/bin/env bash
# GPU checks as one script: the tests/kernels suite on the device with compiled Triton (no
# interpreter), benchmarks/paged_kernels.py (device correctness, do_bench timings and a small sweep of
# tile configs), benchmarks/gpu_engine.py (the engine at size 1 on the device: greedy tokens equal
# transformers' on the tiny llama/qwen3/gemma3 models with batching, prefix caching, chunked
# prefill and both preemptions; then output tok/s against transformers' generate), then on 2+ GPUs
# the tensor-parallel tests over NCCL. On CUDA the kernel tests run (pytest-xdist where present)
# alongside the engine checks, and the timed steps run alone.
# Writes env.txt, tests.log, bench.log, kernels.json, engine.log, engine.json and tp.log to $OUT
# (default /tmp/pagedserve-gpu).
#
#   benchmarks/gpu.sh              # on a CUDA machine
#   DEVICE=cpu benchmarks/gpu.sh   # dry run of the same steps on the host (interpreter, CPU bench,
#                                  # engine checks on the CPU kernels, a --quick throughput run)
#
# The engine step needs the tiny models in $MODELS (default .gpu/models): llama/, qwen3/, gemma3/
# from tests/conftest.py's save_tiny_engine_model and smollm2_tok/ (the converted SmolLM2's
# config.json and tokenizer files); see benchmarks/gpu_engine.py. Without them it is skipped.
#
# Python: .venv if it has torch and triton, else a system python that has both (pagedserve is
# then imported from this checkout), else `make install` creates .venv (needs a package index).
# Exit status: 0 when every step ran and passed; the kernel benchmark's targets are reported in
# kernels.json ("targets") and the engine's tok/s in engine.json, not enforced here.
set -uo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/pagedserve-gpu}"
DEVICE="${DEVICE:-cuda}"
TEST_TIMEOUT="${TEST_TIMEOUT:-420}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-300}"
CHECKS_TIMEOUT="${CHECKS_TIMEOUT:-300}"          # engine greedy checks
THROUGHPUT_TIMEOUT="${THROUGHPUT_TIMEOUT:-300}"  # engine tok/s; starts no further model after
THROUGHPUT_BUDGET="${THROUGHPUT_BUDGET:-150}"    # this many seconds of its own
MODELS="${MODELS:-.gpu/models}"
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"

has_stack() { "$1" -c 'import torch, triton' >/dev/null 2>&1; }
if [ -x .venv/bin/python ] && has_stack .venv/bin/python; then
    PY=.venv/bin/python
elif command -v python3 >/dev/null && has_stack python3; then
    PY=python3
else
    make install || { echo "gpu.sh: no python with torch+triton and make install failed" >&2; exit 2; }
    PY=.venv/bin/python
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_WAIT_POLICY=PASSIVE

"$PY" - "$DEVICE" <<'EOF' | tee "$OUT/env.txt"
import sys, torch, triton
device = sys.argv[1]
print(f"python {sys.version.split()[0]} torch {torch.__version__} triton {triton.__version__}")
if device == "cuda":
    if not torch.cuda.is_available():
        sys.exit("gpu.sh: torch sees no CUDA device (set DEVICE=cpu for a dry run on the host)")
    print(f"device {torch.cuda.get_device_name()} capability {torch.cuda.get_device_capability()}")
else:
    print("device cpu (dry run: Triton through the interpreter)")
EOF
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 2
command -v nvidia-smi >/dev/null && nvidia-smi >>"$OUT/env.txt" 2>&1

if [ "$DEVICE" = cuda ]; then
    # compiled Triton on device tensors; tests/conftest.py only sets TRITON_INTERPRET when unset
    export TRITON_INTERPRET=0 PAGEDSERVE_TEST_DEVICE=cuda
else
    export TRITON_INTERPRET=1 PAGEDSERVE_TEST_DEVICE=cpu
fi
: >"$OUT/engine.json"
: >"$OUT/engine.log"

# The engine's greedy checks against transformers (no timings: they may share the machine).
have_models=0
[ -d "$MODELS/llama" ] && [ -d "$MODELS/qwen3" ] && [ -d "$MODELS/gemma3" ] && [ -d "$MODELS/smollm2_tok" ] \
    && have_models=1
engine_checks() {
    if [ "$have_models" -eq 0 ]; then
        echo "== [${SECONDS}s] engine checks skipped: no tiny models in $MODELS" | tee -a "$OUT/engine.log"
        return 0
    fi
    echo "== [${SECONDS}s] engine checks on $DEVICE (benchmarks/gpu_engine.py --checks)"
    timeout "$CHECKS_TIMEOUT" "$PY" benchmarks/gpu_engine.py --models "$MODELS" --device "$DEVICE" --checks \
        --out "$OUT/engine.json" 2>&1 | tee -a "$OUT/engine.log"
    return "${PIPESTATUS[0]}"
}

if [ "$DEVICE" = cuda ]; then
    # Compilation-bound kernel tests in the background (pytest-xdist where present) while the engine
    # checks run; the C++ CPU decode kernel is not built here (its tests skip: they are CPU-only).
    workers=()
    "$PY" -c 'import xdist' >/dev/null 2>&1 && workers=(-n "${TEST_WORKERS:-8}")
    echo "== [${SECONDS}s] tests/kernels on $DEVICE (background${workers:+, ${workers[*]}}; log in tests.log)"
    OMP_NUM_THREADS=2 PAGEDSERVE_CPU_KERNELS=0 timeout "$TEST_TIMEOUT" "$PY" -m pytest -q -ra -p no:cacheprovider \
        "${workers[@]}" tests/kernels >"$OUT/tests.log" 2>&1 &
    test_pid=$!
    engine_checks
    checks=$?
    wait "$test_pid"
    tests=$?
    echo "== [${SECONDS}s] tests/kernels on $DEVICE: exit $tests"
    tail -n 30 "$OUT/tests.log"
else
    echo "== [${SECONDS}s] tests/kernels on $DEVICE"
    timeout "$TEST_TIMEOUT" "$PY" -m pytest -q -ra -p no:cacheprovider tests/kernels 2>&1 | tee "$OUT/tests.log"
    tests=${PIPESTATUS[0]}
    engine_checks
    checks=$?
fi

echo "== [${SECONDS}s] benchmarks/paged_kernels.py on $DEVICE"
timeout "$BENCH_TIMEOUT" "$PY" benchmarks/paged_kernels.py --device "$DEVICE" --sweep --out "$OUT/kernels.json" 2>&1 \
    | tee "$OUT/bench.log"
bench=${PIPESTATUS[0]}

# Output tok/s of the engine against transformers' generate (alone on the machine: it is timed).
throughput=0
if [ "$have_models" -eq 1 ]; then
    quick=()
    [ "$DEVICE" = cuda ] || quick=(--quick)
    echo "== [${SECONDS}s] engine throughput on $DEVICE (benchmarks/gpu_engine.py --throughput ${quick[*]})"
    timeout "$THROUGHPUT_TIMEOUT" "$PY" benchmarks/gpu_engine.py --models "$MODELS" --device "$DEVICE" \
        --throughput "${quick[@]}" --budget-s "$THROUGHPUT_BUDGET" --out "$OUT/engine.json" 2>&1 \
        | tee -a "$OUT/engine.log"
    throughput=${PIPESTATUS[0]}
fi

# Tensor parallelism over NCCL: size-2 greedy output equals transformers' and size 1, with prefix
# caching, chunked prefill and both preemptions, and seeded n > 1 (tests/cluster/test_tensor_parallel.py),
# on a machine with at least 2 GPUs. Ranks are Ray actors with one GPU each in a placement group.
tp=0
gpus=$(command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | wc -l || echo 0)
if [ "$DEVICE" = cuda ] && [ "$gpus" -ge 2 ]; then
    echo "== [${SECONDS}s] tensor parallelism, size 2 over NCCL ($gpus GPUs)"
    timeout "$TEST_TIMEOUT" "$PY" -m pytest -q -ra -p no:cacheprovider tests/cluster/test_tensor_parallel.py \
        -k "size_2 or seeded or lost_rank" 2>&1 | tee "$OUT/tp.log"
    tp=${PIPESTATUS[0]}
else
    echo "== [${SECONDS}s] tensor parallelism over NCCL skipped: $gpus GPU(s), 2 needed" | tee "$OUT/tp.log"
fi

echo "gpu.sh: [${SECONDS}s] tests exit $tests, benchmark exit $bench, engine checks exit $checks, engine throughput exit" \
    "$throughput, tensor-parallel exit $tp; results in $OUT"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ] && [ "$checks" -eq 0 ] && [ "$throughput" -eq 0 ] && [ "$tp" -eq 0 ]
