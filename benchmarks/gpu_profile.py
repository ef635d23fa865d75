"""Where a step's time goes on a GPU: wall time per step and torch.profiler's top CUDA kernels.

A random-weight model of Gemma 3 270M's shape (``--models``/gemma3_270m: its config.json and
tokenizer, tokenizer.json gzipped; bf16) served by ``LLM`` at size 1 with hybrid KV. Workload:
16 requests of 4,000 random tokens, 32 output tokens each (EOS ignored). Prints the mean wall
time of prefill steps (2,048-token chunks) and of decode steps (16 sequences), the engine's
host-side split, then a profile of 3 prefill and 3 decode steps: the top CUDA kernels by total
device time and the top host ops by self CPU time. The last line is one JSON object.

    python benchmarks/gpu_profile.py --models .gpu/models [--out profile.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedserve import LLM, SamplingParams  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_steps(llm: LLM, n_requests: int, prompt_len: int, out_len: int, seed: int) -> dict:
    """Every step of one batch timed (synchronized), by kind: prefill (a chunk ran) or decode."""
    engine = llm.engine
    rng = random.Random(seed)
    for i in range(n_requests):
        prompt = [rng.randrange(100, 200000) for _ in range(prompt_len)]
        engine.add_request(f"s{seed}-{i}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))  # fmt: skip
    times: dict[str, list[float]] = {"prefill": [], "decode": []}
    while engine.has_unfinished_requests():
        running = engine.scheduler.running
        decode = all(r.num_computed_tokens >= r.num_prompt_tokens for r in running)
        kind = "decode" if decode and not engine.scheduler.waiting else "prefill"
        sync()
        t0 = time.perf_counter()
        engine.step()
        sync()
        times[kind].append(time.perf_counter() - t0)
    return {k: (sum(v) / len(v) * 1e3 if v else 0.0, len(v)) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=Path, default=Path(".gpu/models"))
    ap.add_argument("--out")
    ap.add_argument("--prompt-len", type=int, default=4000)
    ap.add_argument("--requests", type=int, default=16)
    args = ap.parse_args()
    n, length = args.requests, args.prompt_len
    from benchmarks.gpu_engine import build_gemma3_shape

    folder = build_gemma3_shape(args.models)
    llm = LLM(str(folder), dtype="bfloat16", max_model_len=8192, num_gpu_blocks_override=24577,
              max_num_batched_tokens=2048, max_num_seqs=256)  # fmt: skip
    timed_steps(llm, 4, length, 4, seed=0)  # warm-up: compile the kernels, shapes
    before = dict(llm.engine.stats().step_time)
    means = timed_steps(llm, n, length, 32, seed=1)
    after = llm.engine.stats().step_time
    split = {k: round(after[k] - before[k], 3) for k in after}
    print(f"prefill steps: {means['prefill'][1]}, mean {means['prefill'][0]:.1f} ms; "
          f"decode steps: {means['decode'][1]}, mean {means['decode'][0]:.1f} ms; host split (s) {split}")
    engine = llm.engine
    rng = random.Random(2)
    for i in range(n):
        engine.add_request(f"p{i}", {"prompt_token_ids": [rng.randrange(100, 200000) for _ in range(length)]},
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # fmt: skip
    from torch.profiler import ProfilerActivity, profile

    result = {"prefill_ms": round(means["prefill"][0], 2), "decode_ms": round(means["decode"][0], 2),
              "host_split_s": split}  # fmt: skip
    for phase in ("prefill", "decode"):
        if phase == "decode":
            while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) \
                    or engine.scheduler.waiting:  # fmt: skip
                engine.step()
        sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                engine.step()
            sync()
        events = prof.key_averages()
        cuda = sorted(events, key=lambda e: e.device_time_total, reverse=True)[:12]
        host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
        total_cuda = sum(e.self_device_time_total for e in events) / 1e3
        print(f"\n[{phase}] 3 steps: device time {total_cuda:.1f} ms (kernels' self time summed)")
        print("  top CUDA (total ms, calls, name):")
        for e in cuda:
            print(f"    {e.device_time_total / 1e3:9.2f} {e.count:6d}  {e.key[:90]}")
        print("  top host self CPU (ms, calls, name):")
        for e in host:
            print(f"    {e.self_cpu_time_total / 1e3:9.2f} {e.count:6d}  {e.key[:90]}")
        result[phase] = {
            "device_ms": round(total_cuda, 2),
            "top_cuda": [[e.key[:90], round(e.device_time_total / 1e3, 2), e.count] for e in cuda],
            "top_host": [[e.key[:90], round(e.self_cpu_time_total / 1e3, 2), e.count] for e in host],
        }
    while engine.has_unfinished_requests():
        engine.step()
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
