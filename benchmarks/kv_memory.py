"""How much KV memory is live, and how many requests fit: contiguous reservation vs. paged blocks.

Workload replay as a serving system does it, offline: requests queue in arrival order; the
scheduler admits the next one while memory allows; each running request grows one token a step
until its output length; finished requests leave. Both designs get the same KV budget:

- contiguous (the pre-paging design): each request reserves max_model_len slots up front;
- paged: pagedserve's BlockManager (prefix caching on), allocating blocks as tokens arrive and
  preempting the newest request (recompute) when a step cannot get its slots.

Gemma 3 (``gemma3`` in the output): long prompts (mean ~4,000 tokens) over Gemma 3 270M's layers
(18: every sixth full attention, the others a 512-token sliding window), replayed with chunked
prefill (a 2,048-token step budget) through the BlockManager twice on one byte budget: hybrid KV
(a full-attention group and five sliding-window groups of 3 layers; a block holds 3 layers) against
one table for all layers (a block holds 18 layers, every block kept). Reports KV bytes per running
request, max and mean concurrency, preemptions and steps to finish the workload.

Prints a table, the block manager's per-step cost, and as the last line one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads import DEFAULT_TRACE, Request, long_prompts, mooncake_trace, sharegpt_like  # noqa: E402
from pagedserve.cluster.block_manager import BlockManager  # noqa: E402


def replay_contiguous(reqs: list[Request], budget_tokens: int, max_model_len: int) -> dict:
    slots = budget_tokens // max_model_len
    waiting = deque(r for r in reqs if len(r.prompt_token_ids) + r.output_len <= max_model_len)
    running: list[list[int]] = []  # [tokens so far, final length]
    live_sum = reserved_sum = max_running = steps = running_sum = 0
    while waiting or running:
        while waiting and len(running) < slots:
            r = waiting.popleft()
            running.append([len(r.prompt_token_ids), len(r.prompt_token_ids) + r.output_len])
        max_running = max(max_running, len(running))
        steps += 1
        running_sum += len(running)
        live_sum += sum(s[0] for s in running)
        reserved_sum += len(running) * max_model_len
        for s in running:
            s[0] += 1
        running = [s for s in running if s[0] < s[1]]
    return {
        "live_fraction": live_sum / reserved_sum,
        "max_concurrency": max_running,
        "mean_concurrency": running_sum / steps,
    }


def replay_paged(reqs: list[Request], budget_tokens: int, block_size: int, max_model_len: int) -> dict:
    bm = BlockManager(budget_tokens // block_size, block_size, enable_prefix_caching=True)
    waiting = deque(
        (i, list(r.prompt_token_ids), r.output_len)
        for i, r in enumerate(reqs)
        if len(r.prompt_token_ids) + r.output_len <= max_model_len
    )
    running: dict[int, list] = {}  # id -> [tokens, remaining output, preempted before]
    preempted: set[int] = set()
    watermark = max(1, bm.num_blocks // 100)
    live_sum = used_sum = max_running = preemptions = steps = 0
    concurrency_sum = 0
    while waiting or running:
        while waiting:  # admit in order while the prompt fits above a 1% free-block watermark
            rid, tokens, remaining = waiting[0]
            hit = bm.match_prefix(tokens)
            new = len(tokens) - hit.num_tokens
            if running and bm.num_free_blocks - bm.blocks_needed(new) < watermark:
                break
            if bm.allocate(rid, tokens, new, prefix=hit, count_prefix_stats=rid not in preempted) is None:
                break
            waiting.popleft()
            running[rid] = [tokens, remaining]
        if not running:
            raise RuntimeError("a request does not fit in the empty pool")
        max_running = max(max_running, len(running))
        concurrency_sum += len(running)
        st = bm.stats()
        live_sum += st.live_fraction * st.used_blocks
        used_sum += st.used_blocks
        steps += 1
        for rid in list(running):  # decode: one token each, newest preempted when short
            if rid not in running:
                continue
            tokens, remaining = running[rid]
            tokens.append(rid % 30000 + remaining)
            while bm.allocate(rid, tokens, 1) is None:
                victim = max(running)
                bm.free(victim)
                vt, vr = running.pop(victim)
                preemptions += 1
                preempted.add(victim)
                waiting.appendleft((victim, vt if victim != rid else vt[:-1], vr))
                if victim == rid:
                    break
            if rid not in running:
                continue
            running[rid][1] -= 1
            if running[rid][1] == 0:
                bm.free(rid)
                del running[rid]
    st = bm.stats()
    assert st.free_blocks == bm.num_usable_blocks, "every block must be back in the pool"
    return {
        "live_fraction": live_sum / used_sum,
        "max_concurrency": max_running,
        "mean_concurrency": concurrency_sum / steps,
        "preemptions": preemptions,
        "prefix_blocks_saved_fraction": st.prefix_hits / max(st.prefix_queries, 1),
    }


GEMMA3_LAYERS, GEMMA3_PATTERN, GEMMA3_WINDOW = 18, 6, 512  # Gemma 3 270M
GEMMA3_KV_BYTES_PER_TOKEN_LAYER = 2 * 1 * 256 * 2  # K and V, 1 KV head of 256, bf16


def gemma3_groups(hybrid: bool) -> tuple[list[int | None], int]:
    """(window of each KV group, layers per block) of Gemma 3 270M, as kv_groups.py builds them."""
    if not hybrid:
        return [None], GEMMA3_LAYERS
    full = GEMMA3_LAYERS // GEMMA3_PATTERN  # layers 5, 11, 17
    return [None] + [GEMMA3_WINDOW] * ((GEMMA3_LAYERS - full) // full), full


def replay_chunked(reqs: list[Request], budget_bytes: int, block_size: int, *, hybrid: bool,
                   step_tokens: int = 2048) -> dict:  # fmt: skip
    """The engine's scheduling, block manager only: each step running requests first (a decode
    token, or the next prefill chunk), then waiting ones admitted in order, under one token budget;
    the newest running request is preempted (recompute) when a step cannot get its blocks."""
    windows, layers = gemma3_groups(hybrid)
    block_bytes = layers * block_size * GEMMA3_KV_BYTES_PER_TOKEN_LAYER
    bm = BlockManager(budget_bytes // block_bytes, block_size, enable_prefix_caching=True,
                      group_windows=windows, max_chunk_tokens=step_tokens)  # fmt: skip
    waiting = deque((i, list(r.prompt_token_ids), r.output_len) for i, r in enumerate(reqs))
    running: dict[int, list] = {}  # id -> [tokens, prompt length, remaining output]
    steps = preemptions = max_running = concurrency_sum = bytes_sum = 0
    while waiting or running:
        budget = step_tokens
        for rid in sorted(running):
            if rid not in running or budget == 0:
                continue
            tokens, prompt_len, remaining = running[rid]
            done = bm.num_tokens(rid)
            if done < prompt_len:
                n = min(prompt_len - done, budget)
            else:
                tokens.append(rid % 30000 + remaining)
                n = 1
            while bm.allocate(rid, tokens, n) is None:
                victim = max(running)
                vt, vp, vr = running.pop(victim)
                bm.free(victim)
                preemptions += 1
                if victim == rid and done >= prompt_len:
                    vt = vt[:-1]
                waiting.appendleft((victim, vt, vr))
                if victim == rid:
                    break
            if rid not in running:
                continue
            budget -= n
            if bm.num_tokens(rid) >= prompt_len and n == 1 and done >= prompt_len:
                running[rid][2] -= 1
                if running[rid][2] == 0:
                    bm.free(rid)
                    del running[rid]
        while waiting and budget > 0:
            rid, tokens, remaining = waiting[0]
            hit = bm.match_prefix(tokens)
            n = min(len(tokens) - hit.num_tokens, budget)
            if running and bm.num_free_blocks - bm.blocks_needed(n) < max(1, bm.num_blocks // 100):
                break
            if bm.allocate(rid, tokens, n, prefix=hit) is None:
                break
            waiting.popleft()
            # a preempted request re-prefills its outputs as prompt (recompute)
            running[rid] = [tokens, len(tokens), remaining]
            budget -= n
        if budget == step_tokens:
            raise RuntimeError("a request does not fit in the empty pool")
        steps += 1
        max_running = max(max_running, len(running))
        concurrency_sum += len(running)
        bytes_sum += bm.stats().used_blocks * block_bytes / max(len(running), 1)
    assert bm.stats().free_blocks == bm.num_usable_blocks, "every block must be back in the pool"
    return {"kv_bytes_per_request": bytes_sum / steps, "max_concurrency": max_running,
            "mean_concurrency": concurrency_sum / steps, "preemptions": preemptions, "steps": steps,
            "num_blocks": bm.num_blocks}  # fmt: skip


def synthetic_candidates(rng: random.Random, k: int, eos: int, vocab: int) -> tuple[list[int], list[float]]:
    """One beam's best k tokens and logprobs under a Zipf-shaped next-token distribution whose
    sharpness varies per beam and step (exponent 0.6..1.4 over the vocabulary), EOS among them 2%
    of the time: a stand-in for a model, so that the block manager runs alone."""
    s = rng.uniform(0.6, 1.4)
    norm = math.log(sum(r**-s for r in range(1, 2000)) + ((vocab ** (1 - s)) - 2000 ** (1 - s)) / (1 - s))
    ids = rng.sample(range(3, vocab), k)
    if rng.random() < 0.02:
        ids[rng.randrange(k)] = eos
    return ids, [-s * math.log(r) - norm for r in range(1, k + 1)]


def replay_beams(reqs: list[Request], width: int, block_size: int, *, beams: bool, seed: int = 0) -> dict:
    """Each request as a beam search of ``width`` (or, ``beams=False``, ``width`` parallel samples)
    through the BlockManager alone, as the engine drives it: a beam continuing another forks its
    table, the first write into a shared partly filled block copies it, dropped beams free theirs.
    Counts block-table entries (each beam's own copy, no sharing) against distinct blocks held,
    summed over every step."""
    from pagedserve.cluster.beam import BeamSearch
    from pagedserve.sampling import SamplingParams

    rng = random.Random(seed)
    bm = BlockManager(1 << 20, block_size, enable_prefix_caching=False)
    logical = physical = steps = copies = 0
    eos, vocab = 2, 49152
    for g, r in enumerate(reqs):
        prompt = list(r.prompt_token_ids)
        bm.allocate((g, 0), prompt, len(prompt))
        live = [((g, 0), [], 0.0)]  # (request id, output tokens, score)
        search = None
        if beams:
            params = SamplingParams(use_beam_search=True, beam_width=width, temperature=0,
                                    max_tokens=r.output_len)  # fmt: skip
            search = BeamSearch(params, [eos], r.output_len)
        serial = 0
        for step in range(r.output_len):
            if beams:
                cands = [synthetic_candidates(rng, search.num_candidates, eos, vocab) for _ in live]
                conts = search.advance([o for _, o, _ in live], [sc for _, _, sc in live], cands)
                if search.done:
                    break
                plan = [(c.parent, c.token_id, c.score) for c in conts]
            elif step == 0:  # n samples fork from the prompt at their first token
                plan = [(0, rng.randrange(3, vocab), 0.0) for _ in range(width)]
            else:
                plan = [(i, rng.randrange(3, vocab), 0.0) for i in range(len(live))]
            new_live, used = [], set()
            for parent, token, score in plan:
                rid, out, _ = live[parent]
                if parent in used:
                    serial += 1
                    child = (g, serial)
                    bm.fork(rid, child)
                    rid = child
                used.add(parent)
                new_live.append((rid, [*out, token], score))
            for i, (rid, _, _) in enumerate(live):
                if i not in used:
                    bm.free(rid)
            for rid, out, _ in new_live:
                assert bm.allocate(rid, prompt + out, 1) is not None
            copies += len(bm.take_copies())
            live = new_live
            tables = [bm.block_table(rid) for rid, _, _ in live]
            logical += sum(len(t) for t in tables)
            physical += len({b for t in tables for b in t})
            steps += 1
        for rid, _, _ in live:
            bm.free(rid)
    assert bm.stats().free_blocks == bm.num_usable_blocks, "every block must be back in the pool"
    return {"saved_fraction": 1 - physical / logical, "steps": steps, "copies": copies,
            "mean_blocks_logical": logical / steps, "mean_blocks_physical": physical / steps}  # fmt: skip


def bookkeeping_cost(block_size: int = 16, running: int = 256, steps: int = 400) -> dict:
    """Block work of one decode step with ``running`` requests, and allocate+free of one request."""
    bm = BlockManager(running * 4096 // block_size, block_size)
    toks = {i: [i * 7 + j for j in range(200 + i % 50)] for i in range(running)}
    for i, t in toks.items():
        bm.allocate(i, t, len(t))
    t0 = time.perf_counter()
    for step in range(steps):
        for i, t in toks.items():
            t.append(step)
            bm.allocate(i, t, 1)
    step_ms = (time.perf_counter() - t0) / steps * 1e3
    prompt = list(range(512))
    t0 = time.perf_counter()
    n = 2000
    for k in range(n):
        prompt[0] = k  # distinct prompts: no prefix hits, full hashing cost
        hit = bm.match_prefix(prompt)
        bm.allocate("x", prompt, len(prompt) - hit.num_tokens, prefix=hit)
        bm.free("x")
    return {
        "decode_step_ms": step_ms,
        "running": running,
        "alloc_free_us": (time.perf_counter() - t0) / n * 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--trace", default=str(DEFAULT_TRACE), help="a Mooncake-format trace (.jsonl or .jsonl.gz)"
    )
    ap.add_argument("--num-requests", type=int, default=2000)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument(
        "--budget-seqs", type=int, default=16, help="KV budget = this many max_model_len sequences"
    )
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--trace-block-tokens", type=int, default=16, help="tokens per 512-token trace block")
    ap.add_argument("--beam-requests", type=int, default=100, help="requests of the beam-search workload")
    ap.add_argument("--beam-output-scale", type=float, default=0.25, help="scale their output lengths")
    ap.add_argument("--gemma3-requests", type=int, default=200, help="requests of the Gemma 3 workload")
    ap.add_argument("--gemma3-budget-gib", type=float, default=1.0, help="its KV budget (bf16)")
    args = ap.parse_args()
    budget = args.budget_seqs * args.max_model_len
    workloads = {
        "sharegpt_like": sharegpt_like(args.num_requests, max_model_len=args.max_model_len),
        # the same lengths behind one of 4 system prompts of 256 tokens
        "sharegpt_prefix": sharegpt_like(
            args.num_requests, max_model_len=args.max_model_len, shared_prefix_len=256, num_prefixes=4
        ),
    }
    if Path(args.trace).exists():
        workloads["mooncake"] = mooncake_trace(
            args.trace, num_requests=args.num_requests, block_tokens=args.trace_block_tokens
        )
    print(
        f"KV budget {budget} tokens ({args.budget_seqs} x max_model_len {args.max_model_len}), "
        f"block_size {args.block_size}, {args.num_requests} requests per workload"
    )
    print(
        f"{'workload':<16}{'design':<12}{'live frac':>10}{'max conc':>10}{'mean conc':>10}"
        f"{'preempt':>9}{'prefix saved':>13}{'skipped':>9}"
    )
    result: dict = {}
    for name, reqs in workloads.items():
        t0 = time.perf_counter()
        c = replay_contiguous(reqs, budget, args.max_model_len)
        p = replay_paged(reqs, budget, args.block_size, args.max_model_len)
        skipped = sum(1 for r in reqs if len(r.prompt_token_ids) + r.output_len > args.max_model_len)
        print(
            f"{name:<16}{'contiguous':<12}{c['live_fraction']:>10.3f}{c['max_concurrency']:>10}"
            f"{c['mean_concurrency']:>10.1f}{0:>9}{'-':>13}{skipped:>9}"
        )
        print(
            f"{'':<16}{'paged':<12}{p['live_fraction']:>10.3f}{p['max_concurrency']:>10}"
            f"{p['mean_concurrency']:>10.1f}{p['preemptions']:>9}{p['prefix_blocks_saved_fraction']:>13.3f}"
            f"{skipped:>9}   ({time.perf_counter() - t0:.1f}s)"
        )
        result[name] = {
            "live_fraction_paged": round(p["live_fraction"], 4),
            "live_fraction_contiguous": round(c["live_fraction"], 4),
            "max_concurrency_paged": p["max_concurrency"],
            "max_concurrency_contiguous": c["max_concurrency"],
            "mean_concurrency_paged": round(p["mean_concurrency"], 1),
            "mean_concurrency_contiguous": round(c["mean_concurrency"], 1),
            # means, not maxima: the paged maximum includes requests admitted then preempted
            "concurrency_ratio": round(p["mean_concurrency"] / c["mean_concurrency"], 2),
            "prefix_blocks_saved_fraction": round(p["prefix_blocks_saved_fraction"], 4),
            "preemptions_paged": p["preemptions"],
        }
    beam_reqs = sharegpt_like(args.beam_requests, max_model_len=args.max_model_len, seed=3)
    for r in beam_reqs:
        r.output_len = max(2, int(r.output_len * args.beam_output_scale))
    print(f"\nbeam search vs parallel sampling, {len(beam_reqs)} requests (ShareGPT-like prompts, outputs "
          f"x{args.beam_output_scale}), synthetic next-token distributions; "
          "KV blocks saved by sharing:")  # fmt: skip
    print(f"{'width':>6}{'beam search':>13}{'n samples':>11}{'CoW copies/step':>17}")
    result["beam"] = {}
    for width in (2, 4, 8):
        b = replay_beams(beam_reqs, width, args.block_size, beams=True)
        n = replay_beams(beam_reqs, width, args.block_size, beams=False)
        copies = b["copies"] / b["steps"]
        print(f"{width:>6}{b['saved_fraction']:>13.3f}{n['saved_fraction']:>11.3f}{copies:>17.2f}")
        result["beam"][f"w{width}"] = {"beam_saved_fraction": round(b["saved_fraction"], 4),
                                        "samples_saved_fraction": round(n["saved_fraction"], 4)}  # fmt: skip
    gemma = long_prompts(args.gemma3_requests, mean_input=4000, mean_output=256, seed=5)
    mean_prompt = sum(len(r.prompt_token_ids) for r in gemma) / len(gemma)
    budget_bytes = int(args.gemma3_budget_gib * (1 << 30))
    print(f"\nGemma 3 270M layers (1 full : 5 sliding, window 512), {len(gemma)} requests, prompts mean "
          f"{mean_prompt:.0f} tokens, outputs mean {sum(r.output_len for r in gemma) / len(gemma):.0f}; "
          f"KV budget {args.gemma3_budget_gib} GiB (bf16), chunked prefill 2048 tokens a step:")  # fmt: skip
    print(f"{'design':<22}{'blocks':>8}{'KV MiB/req':>12}{'max conc':>10}{'mean conc':>11}{'preempt':>9}"
          f"{'steps':>8}")  # fmt: skip
    rows = {}
    for name, hybrid in (("every layer's blocks", False), ("hybrid KV", True)):
        t0 = time.perf_counter()
        r = replay_chunked(gemma, budget_bytes, args.block_size, hybrid=hybrid)
        rows[hybrid] = r
        mib = r["kv_bytes_per_request"] / 2**20
        print(f"{name:<22}{r['num_blocks']:>8}{mib:>12.1f}{r['max_concurrency']:>10}"
              f"{r['mean_concurrency']:>11.1f}{r['preemptions']:>9}{r['steps']:>8}"
              f"   ({time.perf_counter() - t0:.1f}s)")  # fmt: skip
    plain, hyb = rows[False], rows[True]
    ideal = GEMMA3_LAYERS * mean_prompt / (
        GEMMA3_LAYERS // GEMMA3_PATTERN * mean_prompt
        + (GEMMA3_LAYERS - GEMMA3_LAYERS // GEMMA3_PATTERN) * min(GEMMA3_WINDOW, mean_prompt)
    )
    less = plain["kv_bytes_per_request"] / hyb["kv_bytes_per_request"]
    conc = hyb["mean_concurrency"] / plain["mean_concurrency"]
    print(f"hybrid KV: {less:.2f}x less KV per request (ideal at the mean prompt: {ideal:.2f}x), "
          f"{conc:.2f}x the mean concurrency, {plain['steps'] / hyb['steps']:.2f}x fewer steps")  # fmt: skip
    result["gemma3"] = {
        "mean_prompt_tokens": round(mean_prompt),
        "kv_mib_per_request_hybrid": round(hyb["kv_bytes_per_request"] / 2**20, 1),
        "kv_mib_per_request_all_layers": round(plain["kv_bytes_per_request"] / 2**20, 1),
        "kv_per_request_ratio": round(plain["kv_bytes_per_request"] / hyb["kv_bytes_per_request"], 2),
        "ideal_ratio": round(ideal, 2),
        "max_concurrency_hybrid": hyb["max_concurrency"],
        "max_concurrency_all_layers": plain["max_concurrency"],
        "mean_concurrency_ratio": round(hyb["mean_concurrency"] / plain["mean_concurrency"], 2),
        "steps_ratio": round(plain["steps"] / hyb["steps"], 2),
        "preemptions_hybrid": hyb["preemptions"],
        "preemptions_all_layers": plain["preemptions"],
    }
    cost = bookkeeping_cost(args.block_size)
    print(
        f"block work per decode step, {cost['running']} running: {cost['decode_step_ms']:.3f} ms; "
        f"allocate+free of a 512-token request: {cost['alloc_free_us']:.1f} us"
    )
    result["bookkeeping"] = {k: round(v, 4) for k, v in cost.items()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
