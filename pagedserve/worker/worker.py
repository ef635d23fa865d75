"""One tensor-parallel rank: its model shard, its shard of the KV pool, and ``execute(plan)``.

The worker keeps, per request, the block table the scheduler sent (as deltas) and its sampling
state (params, generator, tokens so far for penalties). It never decides allocation: each plan
says which blocks to swap, copy and write. Rank 0 samples and returns the tokens.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain

import msgpack
import numpy as np
import torch

from pagedserve.config import CacheConfig
from pagedserve.kernels import cpu as cpu_kernels
from pagedserve.plan import NULL_BLOCK, SampledToken, ScheduledSeq, StepOutput, StepPlan, window_start_block
from pagedserve.sampling import (
    Sampler,
    SamplingBatch,
    SamplingParams,
    SamplingRow,
    compute_prompt_logprobs,
    make_generator,
    num_beam_candidates,
)
from pagedserve.worker.kv_groups import KVGroup, kv_cache_groups, layer_slots
from pagedserve.worker.kv_pool import KVPool, bytes_per_block, host_memory, num_kv_heads_per_rank
from pagedserve.worker.layers import (
    Attention,
    AttentionMetadata,
    prepack_linear_weights,
    split_onednn_weights,
)
from pagedserve.worker.loader import load_model
from pagedserve.worker.models.llama import head_dim_of

logger = logging.getLogger(__name__)

SMALL_STEP_TOKENS = 8  # CPU steps of at most this many tokens run on the calibrated thread count
LARGE_STEP_TOKENS = 128  # CPU steps of at least this many tokens (prefill) run on prefill_threads
# smaller CPU steps whose sequences hold at least this many KV tokens in all run their decode
# attention on prefill_threads (see _size_threads); 0, the default: never
DECODE_ATTENTION_KV_TOKENS = int(os.environ.get("PAGEDSERVE_CPU_DECODE_ATTENTION_KV_TOKENS", "0"))
# prefill steps take prefill_threads only where that is measured clearly faster than one thread
# (calibrate_prefill_threads); PAGEDSERVE_CPU_PREFILL_CALIBRATE=0 takes them as given
PREFILL_CALIBRATE = os.environ.get("PAGEDSERVE_CPU_PREFILL_CALIBRATE", "1") != "0"
# the most of max_threads' time a prefill on prefill_threads may take (0.85 until 2026-12-07: a start
# measured 57.2 against 66.0 ms, 0.87, kept one thread, and served c16 TTFT p50 was 1225 ms against
# 821 with two an hour before; in process the same VM took 0.67x on two)
PREFILL_GAIN = 0.95
# While prefill_threads lose, the calibration is tried again, PREFILL_CALIBRATE_PAUSE_S apart, up to
# PREFILL_CALIBRATE_ATTEMPTS times in all, where a prefill on one thread takes at least
# PREFILL_CALIBRATE_RETRY_S (not for tiny models, whose choice matters little)
PREFILL_CALIBRATE_ATTEMPTS = 3
PREFILL_CALIBRATE_PAUSE_S = 2.0
PREFILL_CALIBRATE_RETRY_S = 0.02
# The decode pool (kernels/cpu_pool.h): served, a decode step's linears and attention take the
# replica's reserved cores too, as helper threads the step never waits for. How many helpers
# (PAGEDSERVE_CPU_DECODE_HELPERS; unset: the replica's share of cores beyond its torch threads,
# 0: none) and how long they spin after a region before they sleep, in microseconds.
DECODE_HELPERS = os.environ.get("PAGEDSERVE_CPU_DECODE_HELPERS")
DECODE_POOL_SPIN_US = int(os.environ.get("PAGEDSERVE_CPU_DECODE_POOL_SPIN_US", "50"))
# PAGEDSERVE_CPU_PREFILL_POOL=1: where the decode pool has helpers (served on 2+ cores), every step
# runs on one torch thread and the pool, prefill chunks included: oneDNN's linears split by output
# features over the pool's threads (layers.split_onednn_weights, a second copy of those weights if
# it takes at most ONEDNN_SPLIT_MEMORY of the host memory left), attention and the elementwise
# kernels in units the pool's threads claim as they come (cpu_pool.h's rows_for), so that no region
# waits at a barrier for a thread whose core another process holds. Off by default: on a 2-vCPU
# Xeon VM with AMX (2026-12-07, SmolLM2 bf16) a 256-token prefill in process took 91 ms against 95
# on two OpenMP threads beside an idle server (its processes take ~17% of a core), 77 against 75
# with them stopped; served (make bench-peers, pagedserve alone) c1 TTFT p50 125 against 127 ms and
# c16 317 against 333 output tok/s, TTFT p50 924 against 885 ms: no gain beyond the noise. (What
# separates the served prefill, ~104 ms a step, from the quiet process's 73 ms is those processes:
# the same in-process prefill took 94-97 ms while they ran idle, at nice 0 or -10 alike.)
PREFILL_POOL = os.environ.get("PAGEDSERVE_CPU_PREFILL_POOL", "0") == "1"
ONEDNN_SPLIT_MEMORY = 0.25
CPU_DEFAULT_KV_BYTES = 1 << 30  # 1 GiB: ~1,450 blocks of 16 tokens for SmolLM2-135M in fp32


def _sample_times(counts: tuple[int, ...], repeats: int, run: Callable[[], object]) -> dict[int, list[float]]:
    """Seconds of `run` on each thread count, interleaved over `repeats` rounds after one that
    warms up (the thread count is left at the last one's)."""
    times: dict[int, list[float]] = {k: [] for k in counts}
    for _ in range(repeats + 1):
        for threads, samples in times.items():
            torch.set_num_threads(threads)
            t0 = time.perf_counter()
            run()
            samples.append(time.perf_counter() - t0)
    return {k: v[1:] for k, v in times.items()}


def _median(samples: list[float]) -> float:
    return sorted(samples)[len(samples) // 2]


@dataclass(slots=True)
class _SeqState:
    tables: list[list[int]]  # per KV group
    row: SamplingRow
    prompt_scored: int = 0  # prompt positions whose next-token logprob was already returned
    outputs: list[int] = field(default_factory=list)
    slid: list[int] = field(default_factory=list)  # per group, leading entries already null


class Worker:
    """The model and KV pool of one rank; executes StepPlans."""

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "auto",
        device: str | None = None,
        seed: int = 0,
        eos_token_ids: tuple[int, ...] = (),
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tp_rank, self.tp_size = tp_rank, tp_size
        torch.manual_seed(seed)
        self.model, self.hf_config = load_model(
            model_path, dtype=dtype, device=self.device, tp_rank=tp_rank, tp_size=tp_size
        )
        self.dtype = next(self.model.parameters()).dtype
        if self.device.type == "cpu":
            prepack_linear_weights(self.model, exact=self._exact_model(model_path))
        self.max_threads = torch.get_num_threads()
        self.small_step_threads = self.max_threads  # see calibrate_threads
        # served, the cores reserved for the HTTP stack join in prefill steps (see _size_threads)
        self.prefill_threads = int(os.environ.get("PAGEDSERVE_CPU_PREFILL_THREADS", "0")) or self.max_threads
        self.eos_token_ids = tuple(eos_token_ids)
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(seed))
        self.states: dict[str, _SeqState] = {}
        self.pool: KVPool | None = None
        self.block_size = 0
        self.kv_groups: list[KVGroup] = kv_cache_groups(self.hf_config)

    def _exact_model(self, model_path: str) -> torch.nn.Module | None:
        """This rank's model in fp32, where a bf16 model on a CPU with AMX may keep its linears in
        GGUF blocks (layers.prepack_linear_weights reads the block values from it, then it is
        dropped): a checkpoint stored in fp32, such as the default model converted from its GGUF
        file. Else None."""
        declared = getattr(self.hf_config, "dtype", None) or getattr(self.hf_config, "torch_dtype", None)
        if self.dtype != torch.bfloat16 or str(declared).removeprefix("torch.") != "float32":
            return None
        if not cpu_kernels.blocks_bf16_enabled() or cpu_kernels.gemm_enabled(torch.bfloat16):
            return None
        model, _ = load_model(model_path, dtype=torch.float32, device=self.device, tp_rank=self.tp_rank,
                              tp_size=self.tp_size)  # fmt: skip
        return model

    # ---- the KV pool ---------------------------------------------------------------------

    def bytes_per_block(self, block_size: int, hybrid: bool = True) -> int:
        """Bytes of one pool block on this rank: K and V of one KV group's layers (all layers
        without hybrid KV or sliding windows)."""
        cfg = self.hf_config
        heads = num_kv_heads_per_rank(cfg.num_key_value_heads, self.tp_size)
        layers = len(kv_cache_groups(cfg, hybrid)[0].layers)
        return bytes_per_block(layers, block_size, heads, head_dim_of(cfg), self.dtype)

    def determine_num_blocks(self, cache: CacheConfig, max_num_batched_tokens: int) -> tuple[int, int]:
        """(device blocks, host blocks) this rank can hold, sized as vLLM does.

        GPU: free memory x gpu_memory_utilization after one profiling forward pass of
        ``max_num_batched_tokens`` tokens (activations peak), unless overridden. CPU: the
        ``kv_cache_memory`` bytes (1 GiB by default).
        """
        per_block = self.bytes_per_block(cache.block_size, not cache.disable_hybrid_kv_cache_manager)
        num_host = int(cache.swap_space * (1 << 30)) // per_block
        if cache.num_gpu_blocks_override:
            return cache.num_gpu_blocks_override, num_host
        if cache.kv_cache_memory is not None or self.device.type != "cuda":
            budget = cache.kv_cache_memory or min(CPU_DEFAULT_KV_BYTES, host_memory()[0] // 4)
            return max(1, budget // per_block), num_host
        return max(1, self._profile_gpu_kv_bytes(cache, max_num_batched_tokens) // per_block), num_host

    @torch.inference_mode()
    def _profile_gpu_kv_bytes(self, cache: CacheConfig, num_tokens: int) -> int:
        bs = cache.block_size
        probe = KVPool.for_model(
            self.hf_config, num_blocks=-(-num_tokens // bs), block_size=bs, dtype=self.dtype,
            device=self.device, tp_size=self.tp_size,
        )  # fmt: skip
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        meta = _metadata(
            [ScheduledSeq("profile", [0] * num_tokens, 0, 0, [[]], True)],
            [[list(range(probe.num_blocks))]], bs, self.device,
        )  # fmt: skip
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        hidden = self.model(ids, meta.positions, meta.attn, probe.kv_caches)
        self.model.compute_logits(hidden[-1:])
        torch.cuda.synchronize()
        activations = torch.cuda.max_memory_allocated() - before
        del probe, hidden
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        used = total - free
        budget = int(total * cache.gpu_memory_utilization) - used - activations
        logger.info("profiled %d tokens: activations %.2f GiB; KV budget %.2f GiB",
                    num_tokens, activations / 2**30, budget / 2**30)  # fmt: skip
        if budget <= 0:
            raise RuntimeError("no GPU memory left for the KV cache: raise --gpu-memory-utilization")
        return budget

    def init_kv_pool(self, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                     hybrid: bool = True) -> None:  # fmt: skip
        """The pool of ``num_blocks`` blocks; with ``hybrid`` (and a model mixing attention
        windows) layers form KV groups (kv_groups.py), each reading its own block tables."""
        self.kv_groups = kv_cache_groups(self.hf_config, hybrid)
        group_of, slot_of = layer_slots(self.kv_groups, self.hf_config.num_hidden_layers)
        attention = [m for m in self.model.modules() if isinstance(m, Attention)]
        assert len(attention) == len(group_of), "one Attention module per layer, in layer order"
        for module, group in zip(attention, group_of):
            module.kv_group = group
        self.pool = KVPool.for_model(
            self.hf_config, num_blocks=num_blocks, block_size=block_size, dtype=self.dtype,
            device=self.device, tp_size=self.tp_size, num_host_blocks=num_host_blocks,
            layer_slots=slot_of,
        )  # fmt: skip
        self.block_size = block_size
        if self.device.type == "cpu" and self.tp_size == 1 and self.max_threads > 1:
            self.calibrate_threads()
        if self.device.type == "cpu" and self.tp_size == 1:
            self.configure_decode_pool()
        # served: prefill_threads includes the cores reserved for the HTTP stack (unless the pool
        # takes the prefill chunks: PREFILL_POOL)
        wide = self.prefill_threads > self.max_threads
        if self.device.type == "cpu" and self.tp_size == 1 and wide and PREFILL_CALIBRATE:
            self.calibrate_prefill_threads()

    def configure_decode_pool(self) -> int:
        """Start the decode pool's helpers (see DECODE_HELPERS): served on 2 cores, one helper on
        the core the HTTP stack shares. Returns how many. In process (SmolLM2 fp32 Q4_1 weights,
        Zen 3, 300 tokens of context each) a decode step took 95-101 ms on one thread against
        65.5 with one helper at batch 16, 40-41 against 26-29 at batch 4, alike at batch 1."""
        helpers = int(DECODE_HELPERS) if DECODE_HELPERS else max(0, self.prefill_threads - 1)
        if self.prefill_threads <= self.max_threads and not DECODE_HELPERS:
            helpers = 0
        if helpers and cpu_kernels.set_decode_pool(helpers, DECODE_POOL_SPIN_US):
            split = 0
            if PREFILL_POOL:  # a second copy of the weights, in at most a share of the memory left
                room = int(host_memory()[0] * ONEDNN_SPLIT_MEMORY)
                split = split_onednn_weights(self.model, helpers + 1, room)
                self.prefill_threads = self.max_threads
            logger.info("%s steps' linears and attention take %d helper thread(s) beside the step's own; "
                        "%d oneDNN linear layers split over them", "all" if PREFILL_POOL else "decode",
                        helpers, split)  # fmt: skip
            return helpers
        return 0

    @torch.inference_mode()
    def calibrate_threads(self, context: int = 128, repeats: int = 5) -> int:
        """How many threads a CPU step of few tokens runs on: one or all, whichever decodes one
        sequence faster here (measured, interleaved, median of `repeats`). Returns the choice.

        With OMP_WAIT_POLICY=PASSIVE every parallel region of a step wakes the sleeping threads,
        which can cost more than a second thread gives, and machines differ: on one without AMX
        one thread won at batch 1 (18.5 against 26.5 ms); on a Sapphire Rapids VM with AMX, where
        one core cannot pull the weights from memory fast enough, two won (26 against 38 ms).
        Runs before any request (the pool's first blocks hold scratch KV that nothing reads later).
        """
        pool, bs = self.pool, self.block_size
        assert pool is not None
        context = min(context, (pool.num_blocks - 1) * bs)
        if context < 1:
            return self.small_step_threads
        table = list(range(-(-(context + 1) // bs)))
        tables = [[table] * len(self.kv_groups)]
        meta = _metadata([ScheduledSeq("calibrate", [0] * context, 0, 0, tables[0], True)], tables, bs,
                         self.device)  # fmt: skip
        ids = torch.zeros(context, dtype=torch.int64, device=self.device)
        self.model(ids, meta.positions, meta.attn, pool.kv_caches)
        meta = _metadata([ScheduledSeq("calibrate", [0], context, 0, tables[0], True)], tables, bs,
                         self.device)  # fmt: skip
        one = torch.zeros(1, dtype=torch.int64, device=self.device)
        samples = _sample_times((1, self.max_threads), repeats,
                                lambda: self.model.compute_logits(self.model(one, meta.positions, meta.attn,
                                                                             pool.kv_caches)))  # fmt: skip
        median = {k: _median(v) for k, v in samples.items()}
        torch.set_num_threads(self.max_threads)
        self.small_step_threads = min(median, key=median.get)
        logger.info("steps of <= %d tokens run on %d thread(s): a decode step took %s",
                    SMALL_STEP_TOKENS, self.small_step_threads,
                    ", ".join(f"{1e3 * t:.1f} ms on {k}" for k, t in median.items()))  # fmt: skip
        return self.small_step_threads

    @torch.inference_mode()
    def calibrate_prefill_threads(self, tokens: int = LARGE_STEP_TOKENS, repeats: int = 5) -> int:
        """How many threads a served CPU prefill step runs on (where prefill_threads, the replica's
        share of all cores, is more than its torch threads): prefill_threads where a `tokens`-token
        prefill runs in at most PREFILL_GAIN of the time on those here (measured, interleaved, the
        fastest of `repeats`), else its torch threads. Returns the choice (kept in prefill_threads).

        The fastest, not the median: this runs while the replica starts, when Serve's other
        processes start too and take the other core at times. On the Sapphire Rapids VM one start
        measured a median 54.2 ms on two threads against 57.9 on one and kept one, where others
        measured 43-48 against 60-62; served on one thread TTFT p50 at c16 was 898 ms, on two 784.
        Where the other core stays busy for all the runs of a round, the fastest misleads too: on
        the Emerald Rapids VM (2026-12-06) starts of the same server measured 73.4 ms on one
        against 53.6 on two, then 77.5 against 82.3 and kept one thread (TTFT p50 at c16 2245 ms,
        against 1529-1557 with two). So while the wider count loses, the rounds are tried again
        a few seconds apart (PREFILL_CALIBRATE_ATTEMPTS): a disturbance only ever slows a run,
        and one clear win is the evidence.

        Served, prefill_threads includes the core reserved for the HTTP stack, so a second thread
        must win clearly in process to win there. On the Zen 5 machine prefill ran 1.7x faster on
        two threads and served TTFT fell (c1 167 -> 144 ms). On a 2-vCPU Sapphire Rapids VM (AMX,
        SmolLM2 bf16) a 256-token prefill took 117.8 ms on one thread and 119.8 on two in
        process, and served on two (the HTTP stack's core shared) 151 ms a step against 118.5
        on one: client TTFT ~170 -> ~137 ms at concurrency 1. That was with OMP_WAIT_POLICY=PASSIVE
        alone, where each parallel region wakes the other thread through the kernel; with the
        engines' bounded spin (router.app.OMP_SPIN_COUNT) a 128-token prefill there took 43-46 ms
        on two threads against 60-62 on one, and two are kept (c16 TTFT p50 1077 -> 784 ms).
        """
        pool, bs = self.pool, self.block_size
        assert pool is not None
        tokens = min(tokens, (pool.num_blocks - 1) * bs)
        if tokens < 1:
            return self.prefill_threads
        table = list(range(-(-tokens // bs)))
        tables = [[table] * len(self.kv_groups)]
        meta = _metadata([ScheduledSeq("calibrate", [0] * tokens, 0, 0, tables[0], True)], tables, bs,
                         self.device)  # fmt: skip
        ids = torch.zeros(tokens, dtype=torch.int64, device=self.device)
        before, base, wide = torch.get_num_threads(), self.max_threads, self.prefill_threads
        for attempt in range(PREFILL_CALIBRATE_ATTEMPTS):
            if attempt:
                time.sleep(PREFILL_CALIBRATE_PAUSE_S)
            samples = _sample_times((base, wide), repeats, lambda: self.model(ids, meta.positions, meta.attn,
                                                                               pool.kv_caches))  # fmt: skip
            best = {k: min(v) for k, v in samples.items()}
            wide_wins = best[wide] <= PREFILL_GAIN * best[base]
            if wide_wins or best[base] < PREFILL_CALIBRATE_RETRY_S:
                break
        torch.set_num_threads(before)
        self.prefill_threads = wide if wide_wins else base
        took = ", ".join(f"{1e3 * t:.1f} ms on {k}" for k, t in best.items())
        logger.info("prefill steps run on %d thread(s): a %d-token prefill took at best %s (round %d)",
                    self.prefill_threads, tokens, took, attempt + 1)  # fmt: skip
        return self.prefill_threads

    # ---- one step ------------------------------------------------------------------------

    def execute_wire(self, plan: bytes) -> bytes:
        """The Ray entry point: a msgpack StepPlan in, a msgpack StepOutput out (never pickle)."""
        out = self.execute(StepPlan.from_wire(msgpack.unpackb(plan, strict_map_key=False)))
        return msgpack.packb(out.to_wire())

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        pool = self.pool
        assert pool is not None, "init_kv_pool first"
        # Order matters: blocks swapped out or copied from may be rewritten by this step's tokens.
        pool.swap_out(plan.swap_out)
        pool.swap_in(plan.swap_in)
        pool.copy_blocks(plan.copies)
        # First: a request id may come back as a new request in this very plan. (A beam's
        # parent is never retired before its fork is first sent: it lives until the group's next
        # step, which needs the fork's candidates.)
        for req_id in plan.finished:
            self.states.pop(req_id, None)
        if not plan.seqs:
            return StepOutput([])
        t0 = time.perf_counter()
        if self.device.type == "cpu":
            self._size_threads(plan.num_tokens, plan.seqs)
        tables = [self._update_state(s) for s in plan.seqs]
        meta = _metadata(plan.seqs, tables, self.block_size, self.device)
        input_ids = torch.tensor(
            list(chain.from_iterable(s.token_ids for s in plan.seqs)), device=self.device
        )
        t1 = time.perf_counter()
        hidden = self.model(input_ids, meta.positions, meta.attn, pool.kv_caches)
        output = StepOutput([])
        ends = meta.query_end.tolist()
        self._prompt_logprobs(plan.seqs, hidden, ends, output)
        rows, row_ids, logits = self._sampling_rows(plan.seqs, hidden, ends)
        t2 = time.perf_counter()
        if rows and self.tp_rank == 0:
            self._sample(rows, row_ids, logits, output)
        output.timings = [t1 - t0, t2 - t1, time.perf_counter() - t2]
        return output

    def _size_threads(self, num_tokens: int, seqs: list[ScheduledSeq]) -> None:
        """The calibrated thread count for a step of few tokens, all threads for larger ones (CPU).

        On the machine without AMX (SmolLM2 bf16 decode, one thread against two, before the fused
        ops): batch 2 19.7 / 26.3 ms, batch 8 26.3 / 29.3 ms, batch 16 38.0 / 31.8 ms; prefill ran
        1.7x faster on two. Steps of LARGE_STEP_TOKENS or more (prefill chunks) run on
        `prefill_threads`, which served is the replica's share of all cores, the one reserved for
        the HTTP stack included: a prefill's parallel regions are long (a linear of 256 rows takes
        ~1 ms), so a thread on a shared core costs little there, unlike in decode steps. Served on
        2 cores (Zen 5, SmolLM2 bf16, `benchmarks/peers.py`), against one thread for every step:
        TTFT p50 at concurrency 1 167 -> 144 ms, at concurrency 16 1840 -> 1526 ms, ITL p50 alike
        (11.1 / 11.4 and 30.0 / 31.1 ms); two threads for every step instead gave 159 and 1510 ms
        but took the ITL p50 at concurrency 16 to 34.8 ms.
        """
        if num_tokens <= SMALL_STEP_TOKENS:
            threads = self.small_step_threads
        elif num_tokens >= LARGE_STEP_TOKENS and self.tp_size == 1:
            threads = self.prefill_threads
        else:
            threads = self.max_threads
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        # With PAGEDSERVE_CPU_DECODE_ATTENTION_KV_TOKENS=N, the decode attention of a step over
        # N or more KV tokens runs on prefill_threads too, whatever the step's linears run on: it
        # is bound by memory (one Zen 3 core pulls ~5 GB/s of blocks at random places in the
        # pool) and a layer's region is long (>= 0.3 ms at 1024 KV tokens). In process (SmolLM2
        # fp32, 16 sequences, 30 layers, one thread against two) 48.3 / 31.6 ms at 300 tokens
        # each (benchmarks/cpu_step.py); served on 2 cores it was not a clear win (the core is
        # the HTTP stack's too: W3 53.6 / 52.0 tok/s in one pair of runs, 43.9 / 51.4 in another),
        # so it is off by default.
        wide = DECODE_ATTENTION_KV_TOKENS > 0 and self.tp_size == 1 and self.prefill_threads > threads
        wide = wide and sum(s.start_pos + len(s.token_ids) for s in seqs) >= DECODE_ATTENTION_KV_TOKENS
        cpu_kernels.set_decode_threads(self.prefill_threads if wide else 0)

    def _update_state(self, s: ScheduledSeq) -> list[int]:
        state = self.states.get(s.req_id)
        if state is None and s.new is not None and "fork_of" in s.new:
            # a beam continuing another: same params and prompt; the plan sends its whole table
            parent = self.states[s.new["fork_of"]]
            row = SamplingRow(parent.row.params, parent.row.prompt_token_ids, [], None)
            state = self.states[s.req_id] = self._new_state(row, parent.prompt_scored)
        if state is None:
            assert s.new is not None, f"first sight of {s.req_id} without its prompt"
            params = SamplingParams.from_dict(s.new["params"])
            gen = make_generator(params.seed, self.device) if params.seed is not None else None
            outputs: list[int] = []
            row = SamplingRow(params, s.new["prompt_token_ids"], outputs, gen)
            state = self.states[s.req_id] = self._new_state(row, outputs=outputs)
        for g, (table, blocks) in enumerate(zip(state.tables, s.new_blocks, strict=True)):
            del table[s.table_start :]
            table.extend(blocks)
            window = self.kv_groups[g].window
            if window is not None:
                # entries wholly before the window of this step's first query are never read;
                # the scheduler may already have given their blocks to other requests
                lo = window_start_block(window, s.start_pos, self.block_size)
                for i in range(min(state.slid[g], s.table_start), min(lo, len(table))):
                    table[i] = NULL_BLOCK
                state.slid[g] = lo
        return state.tables

    def _new_state(self, row: SamplingRow, prompt_scored: int = 0,
                   outputs: list[int] | None = None) -> _SeqState:  # fmt: skip
        """A request's state with an empty block table per KV group."""
        groups = len(self.kv_groups)
        outputs = outputs if outputs is not None else []
        return _SeqState([[] for _ in range(groups)], row, prompt_scored, outputs, [0] * groups)

    def _prompt_logprobs(self, seqs: list[ScheduledSeq], hidden: torch.Tensor, ends: list[int],
                         output: StepOutput) -> None:  # fmt: skip
        for s, end in zip(seqs, ends):
            state = self.states[s.req_id]
            k = state.row.params.prompt_logprobs
            prompt = state.row.prompt_token_ids
            if k is None or state.prompt_scored >= len(prompt) - 1:
                continue
            # positions [first, last) of this chunk predict prompt tokens first+1 .. last
            first = max(s.start_pos, state.prompt_scored)
            last = min(s.start_pos + len(s.token_ids), len(prompt) - 1)
            if last <= first:
                continue
            begin = end - len(s.token_ids) + (first - s.start_pos)
            logits = self.model.compute_logits(hidden[begin : begin + last - first])
            entries = compute_prompt_logprobs(logits, prompt[first : last + 1], k)[1:]
            output.prompt_logprobs[s.req_id] = [
                [e.token_id, e.logprob, e.rank, e.top_token_ids, e.top_logprobs] for e in entries
            ]
            state.prompt_scored = last

    def _sampling_rows(
        self, seqs: list[ScheduledSeq], hidden: torch.Tensor, ends: list[int]
    ) -> tuple[list[SamplingRow], list[str], torch.Tensor | None]:
        """The rows to sample this step (forks included) and their logits.

        Every rank keeps the forks' state and computes the logits (the vocabulary-parallel LM head
        is a collective that all ranks must join); only rank 0 samples.
        """
        rows: list[SamplingRow] = []
        row_ids: list[str] = []
        hidden_rows: list[int] = []
        for s, end in zip(seqs, ends):
            if not s.sample:
                continue
            state = self.states[s.req_id]
            for k, fork_id in enumerate([s.req_id, *s.fork_ids]):
                if k:  # a parallel sample: same prompt and blocks, its own params and generator
                    params = state.row.params.for_sample(k)
                    gen = make_generator(params.seed, self.device) if params.seed is not None else None
                    outputs: list[int] = []
                    row = SamplingRow(params, state.row.prompt_token_ids, outputs, gen)
                    tables = [list(t) for t in state.tables]
                    state_k = _SeqState(tables, row, state.prompt_scored, outputs, list(state.slid))
                    self.states[fork_id] = state_k
                rows.append(self.states[fork_id].row)
                row_ids.append(fork_id)
                hidden_rows.append(end - 1)
        if not rows:
            return rows, row_ids, None
        logits = self.model.compute_logits(hidden[torch.tensor(hidden_rows, device=hidden.device)])
        return rows, row_ids, logits

    def _sample(self, rows: list[SamplingRow], row_ids: list[str], logits: torch.Tensor,
                output: StepOutput) -> None:  # fmt: skip
        beam = [i for i, row in enumerate(rows) if row.params.use_beam_search]
        if beam:
            self._beam_candidates([row_ids[i] for i in beam], [rows[i] for i in beam], logits[beam], output)
            if len(beam) == len(rows):
                return
            keep = [i for i, row in enumerate(rows) if not row.params.use_beam_search]
            rows, row_ids, logits = [rows[i] for i in keep], [row_ids[i] for i in keep], logits[keep]
        result = self.sampler(logits, SamplingBatch.from_rows(rows, self.eos_token_ids, self.device))
        for i, (req_id, row) in enumerate(zip(row_ids, rows)):
            token = result.sampled_token_ids[i]
            row.output_token_ids.append(token)
            output.sampled.append(
                SampledToken(req_id, token, result.logprobs[i], result.ranks[i], result.top_token_ids[i],
                             result.top_logprobs[i])
            )  # fmt: skip


    def _beam_candidates(self, row_ids: list[str], rows: list[SamplingRow], logits: torch.Tensor,
                         output: StepOutput) -> None:  # fmt: skip
        """Each beam row's best K tokens by log-softmax (fp32, as transformers scores beams)."""
        ks = [num_beam_candidates(row.params, self.eos_token_ids) for row in rows]
        logprobs = logits.float().log_softmax(dim=-1)
        values, ids = logprobs.topk(min(max(ks), logprobs.shape[-1]), dim=-1)
        values_list, ids_list = values.tolist(), ids.tolist()
        for i, (req_id, k) in enumerate(zip(row_ids, ks)):
            output.beam_candidates[req_id] = [ids_list[i][:k], values_list[i][:k]]


@dataclass(slots=True)
class _StepMeta:
    positions: torch.Tensor
    attn: AttentionMetadata
    query_end: np.ndarray


def _metadata(seqs: list[ScheduledSeq], tables: list[list[list[int]]], block_size: int,
              device: torch.device) -> _StepMeta:  # fmt: skip
    """Positions, slot mappings and block tables (of each KV group: ``tables[seq][group]``) of
    one step, vectorized over the tokens."""
    num_seqs = len(seqs)
    q_lens = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=num_seqs)
    starts = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=num_seqs)
    qsl = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=qsl[1:])
    seq_of_token = np.repeat(np.arange(num_seqs), q_lens)
    positions = np.arange(int(qsl[-1])) - qsl[:-1][seq_of_token] + starts[seq_of_token]
    width = max(len(t[0]) for t in tables)
    groups = []
    for g in range(len(tables[0])):
        block_tables = np.zeros((num_seqs, width), dtype=np.int64)
        for i, t in enumerate(tables):
            block_tables[i, : len(t[g])] = t[g]
        slots = block_tables[seq_of_token, positions // block_size] * block_size + positions % block_size
        groups.append((torch.from_numpy(slots).to(device),
                       torch.from_numpy(block_tables.astype(np.int32)).to(device)))  # fmt: skip
    seq_lens = starts + q_lens
    attn = AttentionMetadata(
        slot_mapping=groups[0][0],
        block_tables=groups[0][1],
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
        query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(device),
        max_query_len=int(q_lens.max()),
        max_seq_len=int(seq_lens.max()),
        groups=tuple(groups) if len(groups) > 1 else (),
    )
    return _StepMeta(torch.from_numpy(positions).to(device), attn, qsl[1:])
