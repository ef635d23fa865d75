"""Tensor-parallel step overhead: how much a step costs beyond the slowest rank's own work.

Workload: a Llama of SmolLM2-135M's shape (30 layers, hidden 576, intermediate 1536, vocab 49152)
but with 8 attention heads and 4 KV heads, so that 2 ranks divide it; random weights made here
(nothing is downloaded), fp32 on CPU, gloo. 32 requests of 32-token prompts decode together;
after they all reach decode, 200 decode steps are timed. Per step: the executor's wall time
(serialize the plan, deliver it to every rank, wait for all outputs, deserialize rank 0's)
minus the slowest rank's time inside its step (unpack, model with its all-reduces, sample).

Three plan transports at size 2: a socket per rank (the default), a Ray Compiled Graph
(shared-memory channels set up once) and one plain actor call per rank per step (the baseline).
Then output tokens/s at size 1 (in process) against size 2 on the same workload; on a 2-core
CPU size 2 is not faster (each rank gets one core, and the all-reduces cost more than halving
small matmuls saves): it shows the cost of the group, not a speed-up. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.cluster.engine import Engine  # noqa: E402
from pagedserve.worker.loader import load_tokenizer, resolve_model  # noqa: E402


def make_model(folder: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                         tie_word_embeddings=True, rope_theta=100000.0, bos_token_id=1, eos_token_id=2,
                         architectures=["LlamaForCausalLM"])  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    load_tokenizer(resolve_model(None)).save_pretrained(folder)
    return folder


def prompts(n: int, length: int) -> list[list[int]]:
    return [[(7919 * i + 104729 * j) % 49000 + 100 for j in range(length)] for i in range(n)]


def fill_to_decode(engine: Engine, num_requests: int, prompt_len: int, max_tokens: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts(num_requests, prompt_len)):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running) or \
            engine.scheduler.waiting:  # fmt: skip
        engine.step()


def measure_overhead(model: Path, transport: str, args: argparse.Namespace) -> dict:
    llm = LLM(str(model), tensor_parallel_size=2, dtype="float32", max_model_len=512,
              num_gpu_blocks_override=args.blocks, plan_transport=transport)  # fmt: skip
    engine, executor = llm.engine, llm.engine.executor
    try:
        fill_to_decode(engine, args.requests, args.prompt_len, args.steps + 50)
        for _ in range(10):  # warm-up decode steps
            engine.step()
        overheads, walls = [], []
        for _ in range(args.steps):
            assert len(engine.scheduler.running) == args.requests
            engine.step()
            overheads.append(executor.last_step_s - executor.last_rank_s)
            walls.append(executor.last_step_s)
    finally:
        llm.shutdown()
    ms = sorted(1000 * o for o in overheads)
    return {"median_ms": statistics.median(ms), "p99_ms": ms[int(0.99 * (len(ms) - 1))],
            "step_ms": 1000 * statistics.median(walls)}  # fmt: skip


def measure_throughput(model: Path, tp: int, args: argparse.Namespace) -> float:
    llm = LLM(str(model), tensor_parallel_size=tp, dtype="float32", max_model_len=512,
              num_gpu_blocks_override=args.blocks)  # fmt: skip
    try:
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        reqs = [{"prompt_token_ids": p} for p in prompts(args.requests, args.prompt_len)]
        llm.generate(reqs[:2], SamplingParams(max_tokens=4))  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(reqs, params)
        elapsed = time.perf_counter() - t0
    finally:
        llm.shutdown()
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=64, help="for the throughput comparison")
    parser.add_argument("--blocks", type=int, default=1024)
    args = parser.parse_args()

    import ray

    from pagedserve.cluster.executor import init_ray

    temp_dir = init_ray(None)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "smollm2-shaped-8h")
        kinds = ("socket", "compiled_graph", "actor_call")
        paths = {kind: measure_overhead(model, kind, args) for kind in kinds}
        tput1 = measure_throughput(model, 1, args)
        tput2 = measure_throughput(model, 2, args)
    ray.shutdown()
    if temp_dir:
        import shutil

        shutil.rmtree(temp_dir, ignore_errors=True)

    fast, base = paths["socket"], paths["actor_call"]
    print(f"\nsize 2, {args.requests} running requests, {args.steps} decode steps, {os.cpu_count()} cores")
    print(f"{'plan transport':<34}{'overhead p50 ms':>16}{'overhead p99 ms':>16}{'step p50 ms':>13}")
    names = {"socket": "socket per rank (default)", "compiled_graph": "Ray compiled graph",
             "actor_call": "actor call per rank (baseline)"}  # fmt: skip
    for kind, r in paths.items():
        print(f"{names[kind]:<34}{r['median_ms']:>16.2f}{r['p99_ms']:>16.2f}{r['step_ms']:>13.1f}")
    print(f"\noutput tok/s, {args.requests} requests x {args.output_len} tokens: size 1 {tput1:.1f}, "
          f"size 2 {tput2:.1f} (size 2 / size 1 = {tput2 / tput1:.2f}; on {os.cpu_count()} cores size 2 "
          "is not expected to be faster)")  # fmt: skip
    figures = {
        "step_overhead_ms_fast": fast["median_ms"], "step_overhead_ms_baseline": base["median_ms"],
        "step_overhead_p99_ms_fast": fast["p99_ms"], "step_overhead_p99_ms_baseline": base["p99_ms"],
        "step_overhead_ms_compiled_graph": paths["compiled_graph"]["median_ms"],
        "step_overhead_p99_ms_compiled_graph": paths["compiled_graph"]["p99_ms"],
        "step_ms_fast": fast["step_ms"], "step_ms_compiled_graph": paths["compiled_graph"]["step_ms"],
        "step_ms_baseline": base["step_ms"], "throughput_tok_s_tp1": tput1, "throughput_tok_s_tp2": tput2,
        "throughput_ratio_tp2_over_tp1": tput2 / tput1,
    }  # fmt: skip
    print(json.dumps({k: round(v, 3) for k, v in figures.items()}))


if __name__ == "__main__":
    main()
