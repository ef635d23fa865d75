"""The CPU extension's kernels against the torch code they replace, at SmolLM2's shapes, one run.

Workload (bf16 where the CPU has it, else fp32; one torch thread, as a served replica on 2 cores):

- decode attention: batch 16, 300 tokens of context each, 9 query / 3 KV heads of 64, block size
  16, blocks at random places in a 4096-block pool, 30 layers (each its own blocks, so KV comes
  from memory as in a step): the C++ kernel (``kernels.cpu.paged_decode``) against the torch
  reference (``kernels.reference.paged_attention``: gather into a workspace, masked SDPA);
- the elementwise ops of a 2048-token prefill chunk (rows of 576 and 2 x 1536 features, 30
  layers): RMSNorm with the residual add, NeoX rotary, SiLU-and-mul, fused C++ against torch.

Prints the median time of each and the speedup; the last line is a JSON object of them.

    .venv/bin/python benchmarks/cpu_kernels.py
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import torch

import pagedserve.kernels as kernels
from pagedserve.kernels import cpu, reference
from pagedserve.worker.layers import RMSNorm, RotaryEmbedding, SiluAndMul

LAYERS, BLOCK, HQ, HKV, D = 30, 16, 9, 3, 64


def median_ms(fn: Callable[[], object], repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def decode_case(dtype: torch.dtype, batch: int = 16, context: int = 300) -> dict[str, Callable[[], object]]:
    per_seq = -(-context // BLOCK)
    pool = 4096
    k_cache = torch.randn(pool, BLOCK, HKV, D).to(dtype)
    v_cache = torch.randn(pool, BLOCK, HKV, D).to(dtype)
    tables = [torch.randperm(pool)[: batch * per_seq].view(batch, per_seq).to(torch.int32)
              for _ in range(LAYERS)]  # fmt: skip
    lens = torch.full((batch,), context, dtype=torch.int32)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    q = torch.randn(batch, HQ, D).to(dtype)

    def ours() -> None:
        for t in tables:
            cpu.paged_decode(q, k_cache, v_cache, t, lens, D**-0.5)

    def torch_reference() -> None:
        for t in tables:
            reference.paged_attention(q, k_cache, v_cache, t, lens, starts, scale=D**-0.5, max_query_len=1)

    return {"C++": ours, "torch": torch_reference}


def elementwise_cases(dtype: torch.dtype, rows: int = 2048) -> dict[str, dict[str, Callable[[], object]]]:
    hidden, inter = 576, 1536
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    x, residual = torch.randn(rows, hidden).to(dtype), torch.randn(rows, hidden).to(dtype)
    rope = RotaryEmbedding(D, 4096, 100000.0)
    positions = torch.arange(rows) % 4096
    qkv = torch.randn(rows, (HQ + 2 * HKV) * D).to(dtype)
    act = SiluAndMul()
    sizes = [HQ * D, HKV * D, HKV * D]
    gate_up = torch.randn(rows, 2 * inter).to(dtype)
    cases: dict[str, dict[str, Callable[[], object]]] = {}
    for name, fn in {
        "add + RMSNorm": lambda: [norm(x.clone(), residual.clone()) for _ in range(LAYERS)],
        "rotary": lambda: [rope(positions, *qkv.clone().split(sizes, dim=-1)[:2]) for _ in range(LAYERS)],
        "SiLU-and-mul": lambda: [act(gate_up) for _ in range(LAYERS)],
    }.items():  # fmt: skip
        cases[name] = {"C++": fn, "torch": _unfused(fn)}
    return cases


def _unfused(fn: Callable[[], object]) -> Callable[[], object]:
    """fn with the fused ops off (layers.py's torch code)."""

    def run() -> object:
        kernels.FUSED = False
        try:
            return fn()
        finally:
            kernels.FUSED = True

    return run


def main() -> None:
    torch.set_num_threads(1)
    if cpu.extension() is None:
        raise SystemExit("the C++ CPU extension could not be built")
    dtype = torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32
    cases = {"decode attention b16 x 300": decode_case(dtype), **elementwise_cases(dtype)}
    print(f"dtype {dtype}, 1 thread, {LAYERS} layers each; clone() of the inputs is in both columns")
    print(f"{'kernel':<28}{'C++ ms':>10}{'torch ms':>10}{'speedup':>9}")
    summary = {}
    for name, variants in cases.items():
        ours, theirs = median_ms(variants["C++"]), median_ms(variants["torch"])
        print(f"{name:<28}{ours:>10.2f}{theirs:>10.2f}{theirs / ours:>8.2f}x")
        summary[name] = {"cpp_ms": round(ours, 2), "torch_ms": round(theirs, 2),
                         "speedup": round(theirs / ours, 2)}  # fmt: skip
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
