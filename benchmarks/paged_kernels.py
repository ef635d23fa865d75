"""Paged attention: what reading KV through a block table costs against SDPA over contiguous KV.

On CPU this times the torch reference (the CPU serving path) on SmolLM2-like layer shapes. On a
GPU it first checks the Triton kernels on the device against attention over contiguous KV
(ragged batches, every dtype and block size), then times Llama-3-8B-like layer shapes (32 query
heads, 8 KV heads, head_dim 128, bf16, block size 16) with triton.testing.do_bench (median):
decode at batch 64 x 4096 and 1 x 65536, and a 4096-token prefill. Each case prints achieved
KV GB/s (KV bytes read once / time), TFLOP/s (causal pairs counted once, i.e. half the square)
and paged / contiguous time. The last line is one JSON object with every figure.

    python benchmarks/paged_kernels.py [--device cpu|cuda] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from pagedserve import kernels

# H200 targets from issue 3; decode's bandwidth target applies to launches reading >= 0.5 GB of KV
TARGET_DECODE_GBPS = 3700.0
TARGET_DECODE_MIN_KV_GB = 0.5
TARGET_PAGED_OVER_CONTIGUOUS = 1.05
TARGET_PREFILL_TFLOPS = 350.0


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    context: int  # KV length of every sequence, this step's tokens included
    q_len: int  # new tokens per sequence: 1 for decode, context for a fresh prefill
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int

    def kv_bytes(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.batch * self.context * self.num_kv_heads * self.head_dim * element

    def flops(self) -> float:
        # query i of a chunk sees context - q_len + i + 1 keys; QK^T and PV are 2 FLOPs a MAC each
        pairs = self.q_len * (self.context - self.q_len) + self.q_len * (self.q_len + 1) / 2
        return 4.0 * self.batch * self.num_q_heads * self.head_dim * pairs


@dataclass
class Result:
    name: str
    paged_ms: float
    contiguous_ms: float
    ratio: float  # paged / contiguous
    kv_gbps: float
    tflops: float
    kv_gb: float
    max_err: float


CPU_CASES = [
    Case("decode b32 x 1024", 32, 1024, 1, 9, 3, 64, torch.float32, 16),
    Case("decode b1 x 8192", 1, 8192, 1, 9, 3, 64, torch.float32, 16),
    Case("decode b32 x 1024 bf16", 32, 1024, 1, 9, 3, 64, torch.bfloat16, 16),
    Case("prefill 1024", 1, 1024, 1024, 9, 3, 64, torch.float32, 16),
    Case("chunk 256 on 2048", 1, 2048, 256, 9, 3, 64, torch.float32, 16),
]
GPU_CASES = [
    Case("decode b64 x 4096", 64, 4096, 1, 32, 8, 128, torch.bfloat16, 16),
    Case("decode b1 x 65536", 1, 65536, 1, 32, 8, 128, torch.bfloat16, 16),
    Case("prefill 4096", 1, 4096, 4096, 32, 8, 128, torch.bfloat16, 16),
]


def build(case: Case, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """A pool with every sequence's blocks scattered by a random permutation, plus the same KV
    laid out contiguously per sequence as [B, Hkv, L, D] (SDPA's layout)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    b, n, bs = case.batch, case.context, case.block_size
    per_seq = -(-n // bs)
    shape = (b * per_seq, bs, case.num_kv_heads, case.head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device, dtype=case.dtype)
    v_cache = torch.randn(shape, generator=gen, device=device, dtype=case.dtype)
    tables = torch.randperm(b * per_seq, generator=gen, device=device).view(b, per_seq).int()

    def contiguous(cache: torch.Tensor) -> torch.Tensor:
        rows = cache[tables.long()].view(b, per_seq * bs, case.num_kv_heads, case.head_dim)[:, :n]
        return rows.transpose(1, 2).contiguous()

    query = torch.randn(b * case.q_len, case.num_q_heads, case.head_dim, generator=gen, device=device,
                        dtype=case.dtype)
    return {
        "query": query, "k_cache": k_cache, "v_cache": v_cache, "block_tables": tables,
        "seq_lens": torch.full((b,), n, dtype=torch.int32, device=device),
        "query_start_loc": torch.arange(b + 1, dtype=torch.int32, device=device) * case.q_len,
        "k": contiguous(k_cache), "v": contiguous(v_cache),
    }


def contiguous_sdpa(case: Case, t: dict[str, torch.Tensor]) -> list[Callable[[], torch.Tensor]]:
    """Ways torch SDPA runs this case over contiguous KV; the benchmark keeps the fastest. Each
    returns [num_tokens, Hq, D] like paged_attention."""
    b, q_len, hq, hkv, d = case.batch, case.q_len, case.num_q_heads, case.num_kv_heads, case.head_dim
    group, n = hq // hkv, case.context
    q = t["query"].view(b, q_len, hq, d).transpose(1, 2)
    k, v = t["k"], t["v"]
    scale = d**-0.5
    mask = None
    if q_len < n:
        pos = torch.arange(n, device=q.device)
        mask = pos[None] <= pos[n - q_len :, None]

    def out(o: torch.Tensor) -> torch.Tensor:
        return o.reshape(b, hq, q_len, d).transpose(1, 2).reshape(b * q_len, hq, d)

    def gqa() -> torch.Tensor:
        return out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                  scale=scale, enable_gqa=True))

    def grouped() -> torch.Tensor:
        # each KV head's query heads as one batch entry over an expanded (not copied) view of its KV
        shape = (b, hkv, group, n, d)
        return out(F.scaled_dot_product_attention(
            q.reshape(b, hkv, group, q_len, d), k[:, :, None].expand(shape), v[:, :, None].expand(shape),
            attn_mask=mask, is_causal=mask is None, scale=scale))

    def folded() -> torch.Tensor:
        # decode only: the query heads of a KV head are its query rows
        return F.scaled_dot_product_attention(t["query"].view(b, hkv, group, d), k, v,
                                              scale=scale).reshape(b * q_len, hq, d)

    return [gqa, folded] if q_len == 1 else [gqa, grouped]


def time_ms(fns: list[Callable[[], object]], device: torch.device) -> list[float]:
    """Median milliseconds of each fn: triton.testing.do_bench on a GPU; on the host, rounds that
    run every fn once in turn, so that load from other processes hits all of them alike."""
    if device.type == "cuda":
        import triton.testing

        return [float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")) for fn in fns]
    for fn in fns:
        fn()
    runs: list[list[float]] = [[] for _ in fns]
    deadline = time.perf_counter() + 4.0
    while len(runs[0]) < 5 or (len(runs[0]) < 50 and time.perf_counter() < deadline):
        for fn, times in zip(fns, runs):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
    return [statistics.median(times) for times in runs]


def run_case(case: Case, device: torch.device) -> Result:
    t = build(case, device)
    scale = case.head_dim**-0.5

    def paged() -> torch.Tensor:
        return kernels.paged_attention(t["query"], t["k_cache"], t["v_cache"], t["block_tables"],
                                       t["seq_lens"], t["query_start_loc"], scale=scale,
                                       max_query_len=case.q_len, max_seq_len=case.context)

    baselines = contiguous_sdpa(case, t)
    expected = baselines[0]().float()
    err = max((fn().float() - expected).abs().max().item() for fn in [paged, *baselines[1:]])
    paged_ms, *contiguous = time_ms([paged, *baselines], device)
    contiguous_ms = min(contiguous)
    return Result(case.name, paged_ms, contiguous_ms, paged_ms / contiguous_ms,
                  case.kv_bytes() / paged_ms / 1e6, case.flops() / paged_ms / 1e9, case.kv_bytes() / 1e9, err)


# (BLOCK_M, TILE_N, num_warps, num_stages) tried by --sweep, around attention._tile_config's choice
SWEEP_DECODE = [(16, 32, 4, 3), (16, 64, 4, 3), (16, 64, 4, 4), (16, 128, 4, 3), (16, 64, 8, 3),
                (32, 64, 4, 3)]
SWEEP_PREFILL = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 8, 3),
                 (64, 128, 4, 3), (128, 64, 8, 4)]


def sweep(case: Case, device: torch.device) -> dict[str, float | None]:
    """Paged time (ms) of each candidate tile config on this case; None where it does not compile
    (too much shared memory) or run."""
    from pagedserve.kernels import attention

    t = build(case, device)
    args = [t[k] for k in ("query", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc")]
    chosen = attention._tile_config
    times: dict[str, float | None] = {}
    try:
        for cfg in SWEEP_DECODE if case.q_len == 1 else SWEEP_PREFILL:
            attention._tile_config = lambda *_, _cfg=cfg: _cfg
            fn = lambda: kernels.paged_attention(*args, scale=case.head_dim**-0.5, max_query_len=case.q_len,
                                                 max_seq_len=case.context)
            name = "m{}-n{}-w{}-s{}".format(*cfg)
            try:
                times[name] = time_ms([fn], device)[0]
            except Exception as e:  # a config that cannot compile (shared memory) is a data point too
                times[name] = None
                print(f"  {case.name} {name}: {type(e).__name__}: {str(e)[:100]}")
    finally:
        attention._tile_config = chosen
    return times


def check_on_device(device: torch.device) -> dict[str, float]:
    """Ragged batches through the dispatch (Triton on a GPU) against per-sequence SDPA over the
    contiguous K/V they were written from: max |error| per (dtype, block size, heads, head_dim).
    tests/kernels covers more combinations; this is the benchmark's own sanity check."""
    errors = {}
    gen = torch.Generator().manual_seed(0)
    seqs = [(1, 1), (37, 1), (700, 1), (256, 256), (900, 130), (77, 1), (2000, 1)]
    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    configs = [(f32, 16, 32, 8, 128), (f16, 16, 32, 8, 128), (bf16, 16, 32, 8, 128), (bf16, 32, 32, 8, 128),
               (bf16, 64, 9, 3, 64), (bf16, 128, 32, 8, 128), (f16, 32, 9, 3, 64), (f32, 64, 8, 8, 64)]
    for dtype, block_size, hq, hkv, d in configs:
        keys = [torch.randn(n, hkv, d, generator=gen).to(dtype) for n, _ in seqs]
        values = [torch.randn(n, hkv, d, generator=gen).to(dtype) for n, _ in seqs]
        per_seq = [-(-n // block_size) for n, _ in seqs]
        perm = torch.randperm(sum(per_seq), generator=gen)
        tables = torch.zeros(len(seqs), max(per_seq), dtype=torch.int32)
        k_cache = torch.zeros(sum(per_seq), block_size, hkv, d, dtype=dtype, device=device)
        v_cache = torch.zeros_like(k_cache)
        used = 0
        for b, (n, _) in enumerate(seqs):
            tables[b, : per_seq[b]] = perm[used : used + per_seq[b]].int()
            used += per_seq[b]
            pos = torch.arange(n)
            slots = (tables[b].long()[pos // block_size] * block_size + pos % block_size).to(device)
            kernels.write_kv(keys[b].to(device), values[b].to(device), k_cache, v_cache, slots)
        queries = [torch.randn(q, hq, d, generator=gen).to(dtype) for _, q in seqs]
        qsl = torch.tensor([0] + [q for _, q in seqs]).cumsum(0).int()
        out = kernels.paged_attention(
            torch.cat(queries).to(device), k_cache, v_cache, tables.to(device),
            torch.tensor([n for n, _ in seqs], dtype=torch.int32, device=device), qsl.to(device),
            scale=d**-0.5,
        ).float().cpu()
        worst = 0.0
        for b, (n, q) in enumerate(seqs):
            mask = torch.arange(n)[None] <= torch.arange(n - q, n)[:, None]
            expected = F.scaled_dot_product_attention(
                queries[b].float().transpose(0, 1), keys[b].float().transpose(0, 1),
                values[b].float().transpose(0, 1), attn_mask=mask, scale=d**-0.5, enable_gqa=True,
            ).transpose(0, 1)
            worst = max(worst, (out[qsl[b] : qsl[b + 1]] - expected).abs().max().item())
        errors[f"{str(dtype)[6:]} bs{block_size} {hq}q{hkv}kv"] = worst
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", help="also write the JSON summary here")
    parser.add_argument("--sweep", action="store_true", help="GPU: also time a few tile configs per case")
    args = parser.parse_args()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    summary: dict[str, object] = {"device": torch.cuda.get_device_name(device) if gpu else "cpu",
                                  "torch": torch.__version__,
                                  "path": "triton" if gpu else "torch reference"}
    if gpu:
        import triton

        summary["triton"] = triton.__version__
        errors = check_on_device(device)
        tolerance = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}
        failed = {k: e for k, e in errors.items() if not e < tolerance[k.split()[0]]}
        print(f"correctness on {summary['device']}: {len(errors) - len(failed)}/{len(errors)} "
              f"configurations within tolerance; worst {max(errors.values()):.2e}"
              + (f"; FAILED {failed}" if failed else ""))
        summary["correct"] = not failed
        summary["max_err"] = errors
    else:
        summary["threads"] = torch.get_num_threads()

    results = []
    print(f"{'case':<24}{'paged ms':>10}{'contig ms':>11}{'ratio':>7}{'KV GB/s':>9}{'TFLOP/s':>9}"
          f"{'KV GB':>8}{'max err':>9}")
    for case in GPU_CASES if gpu else CPU_CASES:
        r = run_case(case, device)
        results.append(r)
        print(f"{r.name:<24}{r.paged_ms:>10.3f}{r.contiguous_ms:>11.3f}{r.ratio:>7.2f}{r.kv_gbps:>9.1f}"
              f"{r.tflops:>9.3f}{r.kv_gb:>8.3f}{r.max_err:>9.1e}")
        if gpu:
            torch.cuda.empty_cache()
    summary["cases"] = [asdict(r) for r in results]
    if gpu and args.sweep:
        summary["sweep"] = {}
        for case in GPU_CASES:
            times = sweep(case, device)
            summary["sweep"][case.name] = times
            ok = {k: v for k, v in times.items() if v is not None}
            best = min(ok, key=ok.get) if ok else None
            print(f"sweep {case.name}: " + ", ".join(f"{k} {v:.3f}" for k, v in ok.items())
                  + (f"; best {best}" if best else ""))
            torch.cuda.empty_cache()
    if gpu:
        decode = [r for r in results if r.name.startswith("decode") and r.kv_gb >= TARGET_DECODE_MIN_KV_GB]
        prefill = [r for r in results if r.name.startswith("prefill")]
        summary["targets"] = {
            "decode_gbps>=3700": all(r.kv_gbps >= TARGET_DECODE_GBPS for r in decode),
            "paged/contiguous<=1.05": all(r.ratio <= TARGET_PAGED_OVER_CONTIGUOUS for r in results),
            "prefill_tflops>=350": all(r.tflops >= TARGET_PREFILL_TFLOPS for r in prefill),
        }
    line = json.dumps(summary, default=str)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
