"""Engine step times on CPU, in process: variants of the model's execution compared in one run.

Workload: the default model (SmolLM2-135M-Instruct) in one Worker with a paged KV pool; decode
steps of batch 1, 4 and 16 over a 300-token context, and a 256-token prefill chunk, each timed
through ``Worker.execute`` (metadata, model, LM head, sampling: what a served step runs). Variants:

- ``fused``: the C++ fused RMSNorm / rotary / SiLU-and-mul / KV write (the default), against
  ``unfused`` (layers.py's torch code, PAGEDSERVE_CPU_FUSED=0);
- ``module loop``: decode steps through the modules' Python loop over the layers, not the one C++
  call of cpu_layers.cpp (PAGEDSERVE_CPU_DECODE_LAYERS=0; where that runs: bf16 GGUF blocks);
- ``threads``: how many torch threads a step of each kind runs on (1 or 2);
- ``dense panels``: the linear layers' weights in cpu_gemm.cpp's dense fp32 panels, not the GGUF
  Q4_1 / Q8_0 blocks the default keeps them in (fp32 on AVX2: cpu.gguf_blocks);
- ``oneDNN linears``: every linear layer on oneDNN's prepacked weights, none on the kernels of
  cpu_gemm.cpp (where the dtype has one on this CPU: fp32 on AVX2, bf16 on AVX512-BF16 without AMX)
  or cpu_blocks_bf16.cpp (bf16 GGUF blocks on AMX: its tiles, steps of up to 64 rows).

Prints the median step time of each (workload, variant) and the ratio to the default's. Then the
decode attention kernel alone over 30 layers' pools of the model's KV shape (random KV, blocks at
random places in pools larger than the caches), 16 sequences of 300 tokens each, and of 800 whose
first 512 are the same blocks in every table (a shared prompt prefix from the prefix cache): one
thread reading shared blocks once for all sequences (the default) or once per sequence
(PAGEDSERVE_CPU_SHARE_BLOCKS=0), and two threads (what a served decode step over that much KV
runs its attention on: Worker._size_threads). Last, as served on 2+ cores (one torch thread, the
decode pool's helpers on the other cores): decode steps with oneDNN's linears whole on the step's
thread against split by output features over the pool (layers.split_onednn_weights). Run with
OMP_WAIT_POLICY=PASSIVE as the server does: ``make bench-step`` (about 4 minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import pagedserve.kernels as kernel_ops
from pagedserve.kernels import cpu as cpu_kernels
from pagedserve.plan import ScheduledSeq, StepPlan
from pagedserve.worker import layers
from pagedserve.worker import worker as worker_module
from pagedserve.worker.loader import resolve_model
from pagedserve.worker.worker import Worker

BLOCK = 16


def _plan(batch: int, start: int, tokens: int, table_start: int, blocks: list[list[int]] | None,
          prompt: int) -> StepPlan:  # fmt: skip
    seqs = []
    for b in range(batch):
        new = None
        if blocks is not None:
            new = {"params": {"temperature": 0.0, "max_tokens": 4096}, "prompt_token_ids": [1] * prompt}
        seqs.append(ScheduledSeq(f"r{b}", [7] * tokens, start, table_start,
                                 [blocks[b] if blocks else []], True, new=new))  # fmt: skip
    return StepPlan(seqs=seqs)


def time_decode(w: Worker, batch: int, context: int, steps: int) -> float:
    """Median time of `steps` decode steps of `batch` sequences after a `context`-token prefill."""
    w.states.clear()
    per_seq = -(-(context + steps + 1) // BLOCK)
    blocks = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    w.execute(_plan(batch, 0, context, 0, blocks, context))
    times = []
    for i in range(steps):
        plan = _plan(batch, context + i, 1, per_seq, None, context)
        t0 = time.perf_counter()
        w.execute(plan)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def time_prefill(w: Worker, tokens: int, repeats: int) -> float:
    per_seq = -(-tokens // BLOCK)
    times = []
    for _ in range(repeats):
        w.states.clear()
        plan = _plan(1, 0, tokens, 0, [list(range(per_seq))], tokens)
        t0 = time.perf_counter()
        w.execute(plan)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def time_attention(w: Worker, context: int, prefix: int, threads: int, share: bool) -> float:
    """Median time of one decode attention call in each of the model's layers over 16 sequences
    of `context` tokens, the first `prefix` of them in the same blocks for all (kernel alone)."""
    batch, pools = 16, w.pool.kv_caches
    per, shared = -(-context // BLOCK), prefix // BLOCK
    num_blocks = pools[0][0].shape[0]
    gen = torch.Generator().manual_seed(context + prefix)
    perm = torch.randperm(num_blocks, generator=gen)
    own = per - shared
    first = perm[:shared].tolist()
    rows = [first + perm[shared + b * own : shared + (b + 1) * own].tolist() for b in range(batch)]
    tables = torch.tensor(rows, dtype=torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32)
    k0 = pools[0][0]
    heads = w.hf_config.num_attention_heads
    q = torch.randn(batch, heads, k0.shape[-1], generator=gen).to(k0.dtype)
    before = cpu_kernels.SHARE_BLOCKS
    cpu_kernels.SHARE_BLOCKS = share
    cpu_kernels.set_decode_threads(threads)
    times = []
    for _ in range(8):
        t0 = time.perf_counter()
        for k, v in pools:
            cpu_kernels.paged_decode(q, k, v, tables, lens, 0.125)
        times.append(time.perf_counter() - t0)
    cpu_kernels.SHARE_BLOCKS = before
    cpu_kernels.set_decode_threads(0)
    return statistics.median(times[2:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3, help="variants interleaved this many times")
    args = ap.parse_args()
    w = Worker(str(resolve_model(None)), dtype=args.dtype)
    w.init_kv_pool(num_blocks=1024, block_size=BLOCK)
    linears = [m for m in w.model.modules() if hasattr(m, "gemm_weight")]
    default_gemm = {m: m.gemm_weight for m in linears}  # GGUF blocks where the weights are
    layers.prepack_linear_weights(w.model, onednn_always=True)  # dense panels and oneDNN's layout
    kernels = {"default": default_gemm, "dense panels": {m: m.gemm_weight for m in linears},
               "oneDNN linears": {m: None for m in linears}}  # fmt: skip
    cores = os.cpu_count() or 1
    variants = {"fused": ("1", None), "unfused": ("0", None), "module loop": ("1", None),
                "fused 1 thread": ("1", 1), f"fused {cores} threads": ("1", cores),
                "dense panels": ("1", None), "oneDNN linears": ("1", None)}  # fmt: skip
    workloads = {"decode b1": lambda: time_decode(w, 1, 300, args.steps),
                 "decode b4": lambda: time_decode(w, 4, 300, args.steps),
                 "decode b16": lambda: time_decode(w, 16, 300, args.steps),
                 "prefill 256": lambda: time_prefill(w, 256, 4)}  # fmt: skip
    results: dict[str, dict[str, list[float]]] = {k: {v: [] for v in variants} for k in workloads}
    for _ in range(args.rounds):  # interleaved, so drift of the machine hits every variant alike
        for name, (fused, threads) in variants.items():
            kernel_ops.FUSED = fused == "1"
            cpu_kernels.DECODE_LAYERS = name != "module loop"
            # threads None: the worker's own policy (its calibrated count for steps of <= 8 tokens)
            worker_module.SMALL_STEP_TOKENS = 8 if threads is None else 0
            w.max_threads = threads or cores
            for m, g in kernels.get(name, default_gemm).items():
                m.gemm_weight = g
            for wl, fn in workloads.items():
                results[wl][name].append(fn())
    kernel_ops.FUSED = cpu_kernels.DECODE_LAYERS = True
    for m, g in default_gemm.items():
        m.gemm_weight = g
    print(f"dtype {w.dtype}, {cores} cores, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}, "
          f"torch {torch.__version__}")  # fmt: skip
    print(f"{'workload':<12} " + " ".join(f"{v:>20}" for v in variants))
    summary = {}
    for wl, per in results.items():
        base = statistics.median(per["fused"])
        cells = []
        for v, ts in per.items():
            m = statistics.median(ts)
            cells.append(f"{m * 1e3:8.2f} ms ({m / base:4.2f}x)")
            summary[f"{wl} {v}"] = round(m * 1e3, 2)
        print(f"{wl:<12} " + " ".join(f"{c:>20}" for c in cells))
    if cpu_kernels.extension() is not None:
        attention = {"1 thread": (1, True), "1 thread, shared blocks per sequence": (1, False),
                     "2 threads": (2, True)}  # fmt: skip
        cases = {"300 tokens": (300, 0), "800, 512 shared": (800, 512)}
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.rounds):
            for case, (context, prefix) in cases.items():
                for name, (threads, share) in attention.items():
                    t = time_attention(w, context, prefix, threads, share)
                    times.setdefault((case, name), []).append(t)
        print(f"decode attention, 16 sequences, {len(w.pool.kv_caches)} layers (kernel alone):")
        for case in cases:
            base = statistics.median(times[(case, "1 thread")])
            cells = []
            for name in attention:
                m = statistics.median(times[(case, name)])
                cells.append(f"{name} {m * 1e3:.2f} ms ({m / base:.2f}x)")
                summary[f"attention {case} {name}"] = round(m * 1e3, 2)
            print(f"  {case:<16} " + "; ".join(cells))
    summary.update(time_onednn_split(w, args.steps, args.rounds, cores))
    print(json.dumps(summary))


def time_onednn_split(w: Worker, steps: int, rounds: int, cores: int) -> dict[str, float]:
    """Decode steps on one torch thread with cores - 1 pool helpers (served), oneDNN's linears
    whole against split over the pool; {} where that does not apply (1 core, no extension)."""
    if cores < 2 or not cpu_kernels.set_decode_pool(cores - 1):
        return {}
    w.max_threads = w.small_step_threads = 1
    worker_module.SMALL_STEP_TOKENS = 8
    if layers.split_onednn_weights(w.model, cores) == 0:
        cpu_kernels.set_decode_pool(0)
        return {}
    split = {m: m.packed_weight for m in w.model.modules() if isinstance(getattr(m, "packed_weight", None),
                                                                        layers.OnednnParts)}  # fmt: skip
    variants = {"whole": {m: p.whole for m, p in split.items()}, "split": split}
    times: dict[tuple[int, str], list[float]] = {}
    for _ in range(rounds):
        for name, weights in variants.items():
            for m, p in weights.items():
                m.packed_weight = p
            for batch in (8, 16):
                times.setdefault((batch, name), []).append(time_decode(w, batch, 300, steps))
    cpu_kernels.set_decode_pool(0)
    print(f"oneDNN linears as served (1 torch thread, {cores - 1} pool helper(s)): whole on the step's "
          "thread against split over the pool")  # fmt: skip
    out = {}
    for batch in (8, 16):
        whole, parts = (statistics.median(times[(batch, v)]) for v in variants)
        ratio = parts / whole
        print(f"  decode b{batch:<3} whole {whole * 1e3:.2f} ms, split {parts * 1e3:.2f} ms ({ratio:.2f}x)")
        out[f"served decode b{batch} whole"], out[f"served decode b{batch} split"] = (
            round(whole * 1e3, 2), round(parts * 1e3, 2))  # fmt: skip
    return out


if __name__ == "__main__":
    main()
