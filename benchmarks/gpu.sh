#!/usr/bin/env bash
# Kernel checks on a GPU, as one script: the tests/kernels suite on the device with compiled
# Triton (no interpreter), then benchmarks/kernels.py (device correctness, do_bench timings and a
# small sweep of tile configs), then on 2+ GPUs the tensor-parallel tests over NCCL.
# Writes env.txt, tests.log, bench.log, kernels.json and tp.log to $OUT (default /tmp/pagedserve-gpu).
#
#   benchmarks/gpu.sh              # on a CUDA machine
#   DEVICE=cpu benchmarks/gpu.sh   # dry run of the same steps on the host (interpreter, CPU bench)
#
# Python: .venv if it has torch and triton, else a system python that has both (pagedserve is
# then imported from this checkout), else `make install` creates .venv (needs a package index).
# Exit status: 0 when tests and benchmark ran and passed; the benchmark's targets are reported
# in kernels.json ("targets"), not enforced here.
set -uo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/pagedserve-gpu}"
DEVICE="${DEVICE:-cuda}"
TEST_TIMEOUT="${TEST_TIMEOUT:-420}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-300}"
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

echo "== tests/kernels on $DEVICE"
timeout "$TEST_TIMEOUT" "$PY" -m pytest -q -ra -p no:cacheprovider tests/kernels 2>&1 | tee "$OUT/tests.log"
tests=${PIPESTATUS[0]}

echo "== benchmarks/kernels.py on $DEVICE"
timeout "$BENCH_TIMEOUT" "$PY" benchmarks/kernels.py --device "$DEVICE" --sweep --out "$OUT/kernels.json" 2>&1 \
    | tee "$OUT/bench.log"
bench=${PIPESTATUS[0]}

# Tensor parallelism over NCCL: size-2 greedy output equals transformers' and size 1, with prefix
# caching, chunked prefill and both preemptions, and seeded n > 1 (tests/cluster/test_tensor_parallel.py),
# on a machine with at least 2 GPUs. Ranks are Ray actors with one GPU each in a placement group.
tp=0
gpus=$(command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | wc -l || echo 0)
if [ "$DEVICE" = cuda ] && [ "$gpus" -ge 2 ]; then
    echo "== tensor parallelism, size 2 over NCCL ($gpus GPUs)"
    timeout "$TEST_TIMEOUT" "$PY" -m pytest -q -ra -p no:cacheprovider tests/cluster/test_tensor_parallel.py \
        -k "size_2 or seeded or lost_rank" 2>&1 | tee "$OUT/tp.log"
    tp=${PIPESTATUS[0]}
else
    echo "== tensor parallelism over NCCL skipped: $gpus GPU(s), 2 needed" | tee "$OUT/tp.log"
fi

echo "gpu.sh: tests exit $tests, benchmark exit $bench, tensor-parallel exit $tp; results in $OUT"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ] && [ "$tp" -eq 0 ]
