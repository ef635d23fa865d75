"""The CPU extension's kernels against the torch code they replace, at SmolLM2's shapes, one run.

Workload (bf16 where the CPU has it, else fp32; one torch thread, as a served replica on 2 cores):

- decode attention: batch 16, 300 tokens of context each, 9 query / 3 KV heads of 64, block size
  16, blocks at random places in a 4096-block pool, 30 layers (each its own blocks, so KV comes
  from memory as in a step): the C++ kernel (``kernels.cpu.paged_decode``) against the torch
  reference (``kernels.reference.paged_attention``: gather into a workspace, masked SDPA);
- the elementwise ops of a 2048-token prefill chunk (rows of 576 and 2 x 1536 features, 30
  layers): RMSNorm with the residual add, NeoX rotary, SiLU-and-mul, fused C++ against torch;
- where bf16 decode runs on AMX tiles (``decode_amx_available()``), the C++ decode attention on
  them against the AVX512-BF16 loop (``set_decode_amx(False)``, as PAGEDSERVE_CPU_DECODE_AMX=0):
  batch 16 at 512 tokens of a shared prefix (one set of blocks every table begins with, as a
  cached prompt) + 300 of each sequence's own, and batch 16 at 300 own tokens, 30 layers.

Prints the median time of each and the speedup; the last line is a JSON object of them.

    .venv/bin/python benchmarks/cpu_kernels.py
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor

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


def paged_kv(dtype: torch.dtype, batch: int, shared: int, own: int
             ) -> tuple[Tensor, Tensor, Tensor, list[Tensor], Tensor]:  # fmt: skip
    """(q, k_cache, v_cache, per-layer block tables, seq_lens) in a 4096-block pool: each sequence
    `shared` tokens whose blocks every table begins with, then `own` tokens in blocks of its own,
    all at random places in the pool, each layer its own blocks."""
    assert shared % BLOCK == 0, "the shared prefix fills whole blocks"
    n_shared, n_own = shared // BLOCK, -(-own // BLOCK)
    pool = 4096
    k_cache = torch.randn(pool, BLOCK, HKV, D).to(dtype)
    v_cache = torch.randn(pool, BLOCK, HKV, D).to(dtype)
    tables = []
    for _ in range(LAYERS):
        blocks = torch.randperm(pool)[: n_shared + batch * n_own].to(torch.int32)
        prefix = blocks[:n_shared].expand(batch, n_shared)
        tables.append(torch.cat([prefix, blocks[n_shared:].view(batch, n_own)], dim=1).contiguous())
    lens = torch.full((batch,), shared + own, dtype=torch.int32)
    return torch.randn(batch, HQ, D).to(dtype), k_cache, v_cache, tables, lens


def decode_fn(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: list[Tensor], lens: Tensor
              ) -> Callable[[], object]:  # fmt: skip
    """The C++ decode attention over every layer's tables."""

    def run() -> None:
        for t in tables:
            cpu.paged_decode(q, k_cache, v_cache, t, lens, D**-0.5)

    return run


def decode_case(dtype: torch.dtype, batch: int = 16, context: int = 300) -> dict[str, Callable[[], object]]:
    q, k_cache, v_cache, tables, lens = paged_kv(dtype, batch, 0, context)
    starts = torch.arange(batch + 1, dtype=torch.int32)

    def torch_reference() -> None:
        for t in tables:
            reference.paged_attention(q, k_cache, v_cache, t, lens, starts, scale=D**-0.5, max_query_len=1)

    return {"C++": decode_fn(q, k_cache, v_cache, tables, lens), "torch": torch_reference}


def amx_decode_cases(batch: int = 16, own: int = 300) -> dict[str, dict[str, Callable[[], object]]]:
    """bf16 decode attention on AMX tiles against the AVX512-BF16 loop, with and without a shared
    512-token prefix."""
    cases = {}
    for name, shared in ((f"b{batch} x (512 shared + {own})", 512), (f"b{batch} x {own}", 0)):
        run = decode_fn(*paged_kv(torch.bfloat16, batch, shared, own))
        cases[name] = {"AMX": _decode_amx(run, True), "loop": _decode_amx(run, False)}
    return cases


def _decode_amx(fn: Callable[[], object], on: bool) -> Callable[[], object]:
    """fn with bf16 decode on AMX tiles on or off (cpu.py's DECODE_AMX restored after)."""
    ext = cpu.extension()

    def run() -> object:
        ext.set_decode_amx(on)
        try:
            return fn()
        finally:
            ext.set_decode_amx(cpu.DECODE_AMX)

    return run


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
    if cpu.decode_amx_enabled():
        print("bf16 decode attention on AMX tiles against the AVX512-BF16 loop, 1 thread, 30 layers each")
        print(f"{'kernel':<28}{'AMX ms':>10}{'loop ms':>10}{'speedup':>9}")
        for name, variants in amx_decode_cases().items():
            amx, loop = median_ms(variants["AMX"]), median_ms(variants["loop"])
            print(f"{name:<28}{amx:>10.2f}{loop:>10.2f}{loop / amx:>8.2f}x")
            summary[f"decode AMX {name}"] = {"amx_ms": round(amx, 2), "loop_ms": round(loop, 2),
                                             "speedup": round(loop / amx, 2)}  # fmt: skip
    else:  # no AMX-BF16 tiles here, or PAGEDSERVE_CPU_DECODE_AMX=0
        print("bf16 decode on AMX tiles: skipped (decode_amx_available() is false)")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
