"""The CPU serving path: decode attention and the KV write in C++ (``cpu_decode.cpp``,
``cpu_ops.cpp``), bf16 prefill attention in C++ (``cpu_prefill.cpp``). The same extension holds the fused
elementwise ops of a decoder layer (RMSNorm with the residual add, rotary, SiLU-and-mul), which
layers.py takes through ``kernels.fused_ops``: in eager torch each of those is 3-25 ops, ~40 a
layer, and at decode batch sizes their dispatch and allocations cost more than their arithmetic.
The extension's functions keep the GIL (torch's own ops release it on every call, and each
release lets the replica's event loop thread in for up to the 5 ms switch interval).

Decode rows (one query token per sequence) go to a C++ kernel that reads K and V in place through
the block tables: the reference gathers every sequence's KV into a workspace first and then runs
a masked SDPA, which on CPU spent more time than the GEMMs at batch 16 (profiled on SmolLM2:
gather 9.8 ms and SDPA 14 ms a step, against 19 ms of linears). Prefill and extend chunks in bf16
run ``cpu_prefill.cpp`` (AMX tiles, or AVX512-BF16 where the CPU has no AMX: prefill_enabled),
others the reference's SDPA. The same signatures as ``reference.py``. ``cpu_layers.cpp`` runs a
step's Llama layers from C++ where all of them have kernels here (DECODE_LAYERS, PREFILL_LAYERS).

The extension is compiled on first use (torch's cpp_extension, ``-O3 -march=native``, about a
minute) into ``$PAGEDSERVE_CACHE_DIR/torch_extensions`` keyed by the sources, torch's version and
this CPU; ``make install`` builds it ahead. Without a compiler it logs once and the reference
serves.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from pagedserve.kernels import reference

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_decode.cpp", "cpu_ops.cpp", "cpu_gemm.cpp",
                                                            "cpu_prefill.cpp", "cpu_blocks_bf16.cpp",
                                                            "cpu_onednn_split.cpp", "cpu_layers.cpp"))
HEADERS = tuple(Path(__file__).with_name(name) for name in ("cpu_vec.h", "cpu_pool.h", "cpu_amx.h",
                                                            "cpu_kernels.h"))
copy_blocks = reference.copy_blocks
swap_blocks = reference.swap_blocks
# Decode rows of sequences whose block tables begin with the same blocks (a shared prompt prefix
# from the prefix cache, the forks of an n > 1 request) read those blocks once for all of them,
# block-major, instead of once per sequence. PAGEDSERVE_CPU_SHARE_BLOCKS=0 turns that off (for
# benchmarks: the results are the same).
SHARE_BLOCKS = os.environ.get("PAGEDSERVE_CPU_SHARE_BLOCKS", "1") != "0"
# bf16 decode attention on AMX tiles (cpu_decode.cpp's decode_bf16_amx: the query rows of every
# sequence that reads a shared block in one tile product) where the CPU has AMX-BF16 and the OS
# grants its tiles, for block sizes that are a multiple of 16 and head dims a multiple of 32;
# PAGEDSERVE_CPU_DECODE_AMX=0 keeps the AVX512-BF16 loop (read once, at import).
DECODE_AMX = os.environ.get("PAGEDSERVE_CPU_DECODE_AMX", "1") != "0"
_decode_threads = 0  # see set_decode_threads


# Steps of a bf16 Llama-family model whose linear layers all have a kernel here or oneDNN's
# prepacked weights run their decoder layers in one C++ call (cpu_layers.cpp; models/llama.py's
# _cpu_layers). PAGEDSERVE_CPU_DECODE_LAYERS=0 keeps decode steps in the modules' Python loop,
# PAGEDSERVE_CPU_PREFILL_LAYERS=0 steps with prefill chunks (both read once, at import).
DECODE_LAYERS = os.environ.get("PAGEDSERVE_CPU_DECODE_LAYERS", "1") != "0"
PREFILL_LAYERS = os.environ.get("PAGEDSERVE_CPU_PREFILL_LAYERS", "1") != "0"


def decode_threads() -> int:
    """The decode attention kernel's thread count (set_decode_threads; 0: torch's)."""
    return _decode_threads


def set_decode_threads(threads: int) -> None:
    """How many threads the decode attention kernel runs on from now on (0: torch's count, what
    the rest of the step runs on). A step that reads a lot of KV can give its attention more
    threads than its linears: that kernel is bound by memory, and its parallel regions are long
    enough that waking a thread on a core shared with the HTTP stack costs little. Process-wide,
    as torch.set_num_threads is; the worker sets it every step."""
    global _decode_threads
    _decode_threads = max(0, int(threads))


def set_decode_pool(helpers: int, spin_us: int = 50) -> bool:
    """Give the decode steps' linears and attention `helpers` threads beside the caller's
    (cpu_pool.h; 0: they run on torch's threads, as before). Unlike an OpenMP team, the caller
    never waits for a helper that has not started: served on 2 cores, where the second is the HTTP
    stack's too, a helper takes the units it gets a core for. Returns whether the pool exists (the
    extension was built). Process-wide."""
    ext = extension()
    if ext is None:
        return False
    ext.set_decode_pool(max(0, int(helpers)), max(0, int(spin_us)))
    return True


def _build_dir() -> Path:
    from pagedserve.worker.loader import cache_dir

    key = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS) + torch.__version__.encode()
                         + _cpu_id().encode() + _march().encode())
    return cache_dir() / "torch_extensions" / f"cpu_decode-{key.hexdigest()[:12]}"


def _march() -> str:
    """The -march the kernels are compiled for: this CPU (``native``) unless ``PAGEDSERVE_CPU_MARCH``
    names another (``haswell`` builds the AVX2 paths on an AVX-512 machine, as the tests do)."""
    return os.environ.get("PAGEDSERVE_CPU_MARCH", "native")


def _cpu_id() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
        model = next((line for line in text.splitlines() if line.startswith("model name")), "")
        return model + flags
    except OSError:
        return platform.processor()


@functools.cache
def _cpu_flags() -> frozenset[str]:
    return frozenset(_cpu_id().split())


@functools.cache
def extension() -> ModuleType | None:
    """The compiled kernel module, or None (logged once) where it cannot be built."""
    if os.environ.get("PAGEDSERVE_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        build = _build_dir()
        build.mkdir(parents=True, exist_ok=True)
        module = load(name="pagedserve_cpu_decode", sources=[str(p) for p in SOURCES],
                      build_directory=str(build),
                      extra_cflags=["-O3", f"-march={_march()}", "-ffast-math", "-fopenmp"],
                      extra_ldflags=["-fopenmp"], verbose=False)  # fmt: skip
        module.set_decode_amx(DECODE_AMX)
        return module
    except Exception as exc:  # no compiler, no headers: the reference serves, slower
        logger.warning("CPU decode kernel unavailable (%s: %s); using the torch reference",
                       type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")  # fmt: skip
        return None


@functools.cache
def gemm_enabled(dtype: torch.dtype) -> bool:
    """Whether linear layers of few rows in `dtype` take the kernels of cpu_gemm.cpp: fp32 where
    the AVX2 kernel was built and the CPU has no AVX-512 (oneDNN's AVX-512 kernels serve those
    shapes well); bf16 where the AVX512-BF16 kernel was built and the CPU has no AMX (whose tiles
    oneDNN uses). ``PAGEDSERVE_CPU_GEMM=1`` or ``0`` decides instead, for the kernels built."""
    ext = extension()
    built = {torch.float32: ext is not None and ext.gemm_available(),
             torch.bfloat16: ext is not None and ext.gemm_bf16_available()}.get(dtype, False)  # fmt: skip
    if not built:
        return False
    forced = os.environ.get("PAGEDSERVE_CPU_GEMM")
    if forced is not None:
        return forced != "0"
    flags = _cpu_flags()
    return "avx512f" not in flags if dtype == torch.float32 else "amx_bf16" not in flags


# bf16 prefill chunks through cpu_prefill.cpp's AMX tiles where the CPU has AMX-BF16 and the OS
# grants its tiles; PAGEDSERVE_CPU_PREFILL_AMX=0 keeps torch's SDPA there (read once, at import).
PREFILL_AMX = os.environ.get("PAGEDSERVE_CPU_PREFILL_AMX", "1") != "0"


def prefill_amx_enabled() -> bool:
    """Whether paged_prefill runs on AMX tiles (see PREFILL_AMX)."""
    ext = extension()
    return ext is not None and PREFILL_AMX and ext.prefill_amx_available()


def prefill_enabled() -> bool:
    """Whether bf16 prefill chunks take cpu_prefill.cpp's kernel (KV read through the block table)
    instead of gathering KV for torch's SDPA: where it was built (AVX512-BF16), through AMX tiles
    where the CPU has AMX (prefill_amx_enabled). Without the tiles, SDPA's own AMX GEMMs beat the
    AVX512-BF16 loop: on a 2-vCPU Sapphire Rapids VM, SmolLM2 bf16, a whole step of 256 new tokens
    over 768 took 144 ms with SDPA against 187-200 with the loop, 1024 new tokens 374-456 against
    536-730. With the tiles (2-vCPU Xeon VM, 2026-12-07, one thread, SmolLM2's 9 x 64 query and 3 KV
    heads): a fresh 256-token chunk 0.78 ms (SDPA with its KV gather) -> 0.26 a layer, 256 after
    512 cached 2.2 -> 0.95 ms, 2048 fresh 21.7 -> 12.0.
    ``PAGEDSERVE_CPU_PREFILL=1`` or ``0`` decides instead, where the kernel was built."""
    ext = extension()
    if ext is None or not ext.prefill_bf16_available():
        return False
    forced = os.environ.get("PAGEDSERVE_CPU_PREFILL")
    if forced is not None:
        return forced != "0"
    return "amx_bf16" not in _cpu_flags() or prefill_amx_enabled()


def write_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """reference.write_kv's contract: one memcpy per token and pool instead of a mask, two
    index_copy_ and their casts."""
    ext = extension()
    if (ext is None or key.dtype != k_cache.dtype or value.dtype != v_cache.dtype or key.device.type != "cpu"
            or slot_mapping.dtype != torch.int64):
        return reference.write_kv(key, value, k_cache, v_cache, slot_mapping)
    ext.write_kv(key.flatten(1), value.flatten(1), k_cache, v_cache, slot_mapping.contiguous())


def decode_amx_enabled() -> bool:
    """Whether bf16 decode attention runs on AMX tiles (see DECODE_AMX; for the shapes it takes)."""
    ext = extension()
    return ext is not None and ext.decode_amx_available()


def paged_decode(query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                 scale: float, sliding_window: int | None = None) -> Tensor:  # fmt: skip
    """Attention of one query token per sequence (query [B, Hq, D]) over its paged KV."""
    ext = extension()
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.int()
    lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.int()
    return ext.paged_decode(query, k_cache, v_cache, tables.contiguous(), lens.contiguous(), scale,
                            sliding_window or 0, SHARE_BLOCKS, _decode_threads)  # fmt: skip


def paged_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
) -> Tensor:
    """reference.paged_attention's contract; decode rows through the C++ kernel, bf16 prefill
    chunks through cpu_prefill.cpp where it was built."""
    ext = extension()
    if ext is None or query.dtype != k_cache.dtype or query.device.type != "cpu":
        return reference.paged_attention(
            query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=scale,
            sliding_window=sliding_window, max_query_len=max_query_len, max_seq_len=max_seq_len,
        )  # fmt: skip
    num_seqs = block_tables.shape[0]
    if max_query_len == 1 and query.shape[0] == num_seqs:  # a decode-only step: no host-side work
        return paged_decode(query, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window)
    layout = reference._layout(block_tables, seq_lens, query_start_loc, k_cache)
    out = torch.empty_like(query)
    if layout.decode:
        tables, lens = layout.decode_tables  # derived once per step, not once per layer
        rows = layout.decode_rows
        out.index_copy_(0, rows, paged_decode(query.index_select(0, rows), k_cache, v_cache, tables, lens,
                                              scale, sliding_window))  # fmt: skip
    fast = (query.dtype == torch.bfloat16 and query.shape[-1] % 16 == 0 and query.shape[-1] <= 256
            and k_cache.is_contiguous() and v_cache.is_contiguous() and prefill_enabled())  # fmt: skip
    amx = fast and prefill_amx_enabled()
    for b in layout.extends:
        rows = slice(layout.starts[b], layout.starts[b] + layout.q_lens[b])
        if fast:  # bf16: cpu_prefill.cpp (AMX tiles or AVX512-BF16), KV read through the table
            table = block_tables[b] if block_tables.dtype == torch.int32 else block_tables[b].int()
            out[rows] = ext.paged_prefill(query[rows], k_cache, v_cache, table, layout.lens[b], scale,
                                          sliding_window or 0, amx)  # fmt: skip
        else:
            out[rows] = reference._extend(query[rows], k_cache, v_cache, layout, b, scale, sliding_window)
    return out


# Linear weights that are exact GGUF Q4_1 or Q8_0 block values (a dequantized GGUF, such as the
# default model's) are kept in those blocks for cpu_gemm.cpp's linear_blocks: the same fp32
# weights, 5-6x fewer bytes streamed per step. PAGEDSERVE_CPU_GGUF_BLOCKS=0 keeps dense panels.
GGUF_BLOCKS = os.environ.get("PAGEDSERVE_CPU_GGUF_BLOCKS", "1") != "0"
_PANEL = 16  # features per panel (cpu_gemm.cpp's NR)
_BLOCK = 32  # k per GGUF block


def _fp16_exact(x: Tensor) -> Tensor:
    return x.half().float() == x


def _q4_1_blocks(b: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """Blocks b [R, 32] as Q4_1 (w = d q + m, d and m fp16, q in 0..15): (q uint8, d, m) if every
    block's values are exactly that, else None. The smallest value is m (q = 0); d comes from the
    largest value over the q that gives it (15 for llama.cpp's quantizer, tried down to 1) and its
    fp16 neighbours."""
    m = b.amin(1)
    if not bool(_fp16_exact(m).all()):
        return None
    span = b.amax(1) - m

    def attempt(rows: Tensor | slice, top: int, ulp: int) -> tuple[Tensor, Tensor, Tensor]:
        cand = (span[rows] / top).half()
        if ulp:
            cand = torch.nextafter(cand, torch.full_like(cand, ulp * 65504.0))
        cand = cand.float()[:, None]
        base, mins = b[rows], m[rows][:, None]
        qi = torch.where(cand > 0, torch.round((base - mins) / cand), 0.0).clamp_(0, 15)
        ok = ((cand * qi + mins) == base).all(1) & (cand[:, 0] >= 0)
        return cand[:, 0], qi.to(torch.uint8), ok

    d, q, ok = attempt(slice(None), 15, 0)  # every block at once: almost all pass here
    d = torch.where(ok, d, 0.0)
    for top, ulp in [(t, u) for t in range(15, 0, -1) for u in (0, -1, 1)][1:]:
        idx = (~ok).nonzero().squeeze(1)
        if not len(idx):
            break
        cand, qi, good = attempt(idx, top, ulp)
        fixed = idx[good]
        d[fixed], q[fixed], ok[fixed] = cand[good], qi[good], True
    return (q, d, m) if bool(ok.all()) else None


def _q8_0_blocks(b: Tensor) -> tuple[Tensor, Tensor] | None:
    """Blocks b [R, 32] as Q8_0 (w = d q, d fp16, q in -127..127): (q int8, d) if every block's
    values are exactly that, else None. llama.cpp's quantizer gives the largest |w| q = +-127."""
    d = b.abs().amax(1) / 127
    if not bool(_fp16_exact(d).all()):
        return None
    q = torch.where(d[:, None] > 0, torch.round(b / d[:, None]), 0.0).clamp(-127, 127)
    if not bool(((d[:, None] * q) == b).all()):
        return None
    return q.to(torch.int8), d


def _gguf_block_values(weight: Tensor) -> tuple[int, int, tuple[Tensor, ...]] | None:
    """A weight [N, K] (fp32) whose every value is an exact GGUF Q4_1 or Q8_0 block value, as
    (panels, blocks per row, (q, d, m) for Q4_1 or (q, d) for Q8_0) over its rows padded with zeros
    to whole panels of 16 features, one block of 32 k a row of q; None where it is not (most
    weights: a dense checkpoint fails on its first row) or K is not a multiple of 32."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % _BLOCK or not weight.numel():
        return None
    n, k = weight.shape
    w = weight.detach().contiguous()
    # a quick look at the first row decides for almost every dense weight
    if _q4_1_blocks(w[:1].reshape(-1, _BLOCK)) is None and _q8_0_blocks(w[:1].reshape(-1, _BLOCK)) is None:
        return None
    panels, kb = -(-n // _PANEL), k // _BLOCK
    padded = torch.zeros(panels * _PANEL, k)
    padded[:n] = w
    blocks = padded.view(panels * _PANEL * kb, _BLOCK)
    found = _q4_1_blocks(blocks)
    if found is None:
        found = _q8_0_blocks(blocks)
    return None if found is None else (panels, kb, found)


def gguf_blocks(weight: Tensor) -> tuple[Tensor, Tensor, bool] | None:
    """A weight [N, K] (fp32) whose every value is an exact GGUF Q4_1 or Q8_0 block value, in
    cpu_gemm.cpp's panel layout for linear_blocks: (q, scales, is_q8); None where it is not."""
    found = _gguf_block_values(weight)
    if found is None:
        return None
    panels, kb, values = found
    if len(values) == 3:
        q, d, m = values
        # [panels, 16 features, kb, 32 k] -> [panels, kb, 32 k, 16 features]
        q = q.view(panels, _PANEL, kb, _BLOCK).permute(0, 2, 3, 1)
        packed = (q[..., :8] | (q[..., 8:] << 4)).contiguous()
        scales = torch.stack([d.view(panels, _PANEL, kb), m.view(panels, _PANEL, kb)], 0)
        return packed, scales.permute(1, 3, 0, 2).contiguous(), False  # [panels, kb, 2, 16]
    q, d = values
    packed = q.view(panels, _PANEL, kb, _BLOCK).permute(0, 2, 3, 1).contiguous()
    return packed, d.view(panels, _PANEL, kb, 1).permute(0, 2, 3, 1).contiguous(), True


def blocks_bf16_enabled() -> bool:
    """Whether bf16 linears of a few rows may take cpu_blocks_bf16.cpp's kernel over GGUF blocks:
    where it was built (AVX512-BF16), unless PAGEDSERVE_CPU_GGUF_BLOCKS=0."""
    ext = extension()
    return GGUF_BLOCKS and ext is not None and ext.blocks_bf16_available()


# bf16 GGUF blocks through AMX tiles (cpu_blocks_bf16.cpp's linear_amx) where the CPU has AMX-BF16
# and the OS grants its tiles; PAGEDSERVE_CPU_BLOCKS_AMX=0 keeps the AVX512-BF16 loop (and its row
# limit) there.
BLOCKS_AMX = os.environ.get("PAGEDSERVE_CPU_BLOCKS_AMX", "1") != "0"


def blocks_amx_enabled() -> bool:
    """Whether bf16 GGUF blocks run on AMX tiles (see BLOCKS_AMX)."""
    ext = extension()
    return blocks_bf16_enabled() and BLOCKS_AMX and ext.blocks_amx_available()


def gguf_blocks_bf16(weight: Tensor) -> tuple[Tensor, bool] | None:
    """A weight [N, K] (fp32) whose every value is an exact GGUF Q4_1 or Q8_0 block value, as
    cpu_blocks_bf16.cpp's records for linear_blocks_bf16: (uint8 [ceil(N / 16), K / 32, record
    bytes], is_q8); None where it is not."""
    found = _gguf_block_values(weight)
    if found is None:
        return None
    panels, kb, values = found

    def fp16_bytes(x: Tensor) -> Tensor:  # [panels * 16 * kb] -> [panels, kb, 32]: 16 fp16 a record
        return x.half().view(panels, _PANEL, kb).permute(0, 2, 1).contiguous().view(torch.uint8)

    q = values[0].view(panels, _PANEL, kb, _BLOCK).permute(0, 2, 1, 3)  # [panels, kb, n, k]
    if len(values) == 3:
        # k = 4 t + 2 h + e: byte (t, n, e) holds h = 0 in its low nibble, h = 1 in its high one
        q = q.reshape(panels, kb, _PANEL, 8, 2, 2).permute(0, 1, 3, 2, 5, 4).reshape(panels, kb, 256, 2)
        nibbles = q[..., 0] | (q[..., 1] << 4)
        return torch.cat([nibbles, fp16_bytes(values[1]), fp16_bytes(values[2])], -1).contiguous(), False
    # k = 2 r + e: byte (r, n, e)
    q = q.reshape(panels, kb, _PANEL, 16, 2).permute(0, 1, 3, 2, 4).reshape(panels, kb, 512)
    return torch.cat([q.view(torch.uint8), fp16_bytes(values[1])], -1).contiguous(), True
