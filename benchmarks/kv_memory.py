"""How much KV memory is live, and how many requests fit: contiguous reservation vs. paged blocks.

Workload replay as a serving system does it, offline: requests queue in arrival order; the
scheduler admits the next one while memory allows; each running request grows one token a step
until its output length; finished requests leave. Both designs get the same KV budget:

- contiguous (the pre-paging design): each request reserves max_model_len slots up front;
- paged: pagedserve's BlockManager (prefix caching on), allocating blocks as tokens arrive and
  preempting the newest request (recompute) when a step cannot get its slots.

Prints a table, the block manager's per-step cost, and as the last line one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads import DEFAULT_TRACE, Request, mooncake_trace, sharegpt_like  # noqa: E402
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
    assert st.free_blocks == bm.num_blocks, "every block must be back in the pool"
    return {
        "live_fraction": live_sum / used_sum,
        "max_concurrency": max_running,
        "mean_concurrency": concurrency_sum / steps,
        "preemptions": preemptions,
        "prefix_blocks_saved_fraction": st.prefix_hits / max(st.prefix_queries, 1),
    }


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
    cost = bookkeeping_cost(args.block_size)
    print(
        f"block work per decode step, {cost['running']} running: {cost['decode_step_ms']:.3f} ms; "
        f"allocate+free of a 512-token request: {cost['alloc_free_us']:.1f} us"
    )
    result["bookkeeping"] = {k: round(v, 4) for k, v in cost.items()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
