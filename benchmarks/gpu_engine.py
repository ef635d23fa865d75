"""The engine end to end on a GPU: greedy tokens equal transformers', then output tok/s against it.

Checks (``--checks``): the tiny random models of tests/conftest.py (``save_tiny_engine_model``,
kinds llama, qwen3 and gemma3; gemma3's sliding window is 16 tokens and the prompts run to 90)
served by ``LLM`` at tensor-parallel size 1 in this process, fp32 with TF32 off, the paged KV
pool and the attention on the device (Triton kernels on CUDA). Each case runs a batch of 12
prompts of 3-90 tokens at once and must give transformers' own greedy tokens (``generate``, one
prompt at a time, same device): a plain batch; prefix caching (the batch twice, the second run
hitting the cache); chunked prefill (a 24-token budget, some prompt split across steps); a pool
of 20 blocks of 8 tokens that forces preemption by recompute, and by swap. Engine stats must show
that each happened, and every block must be free afterwards. Prints PASS/FAIL per case.

Throughput (``--throughput``): a random-weight model of SmolLM2-135M's shape (the converted
config.json, bf16) and, time allowing, a 1B-class Llama (hidden 2048, 16 layers, 32 heads, 8 KV
heads, MLP 8192), saved to a temp folder with SmolLM2's tokenizer. 256 requests of 256 random
token ids, 128 output tokens each (EOS ignored). pagedserve's ``LLM.generate`` (after a warm-up
on other prompts) against transformers' ``generate`` in static batches of 64 (left-padded,
min_new_tokens = max_new_tokens). ``--quick`` shrinks the model and workload for a CPU dry run.

    python benchmarks/gpu_engine.py --models .gpu/models [--checks] [--throughput] [--quick]
        [--out engine.json]

``--models`` holds llama/, qwen3/, gemma3/ (from save_tiny_engine_model) and smollm2_tok/ (the
converted SmolLM2's config.json and tokenizer files). Exit status 1 when any check fails; each
invocation appends one JSON line of figures to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from pagedserve import LLM, SamplingParams, kernels  # noqa: E402

MAX_NEW = 12
KINDS = ("llama", "qwen3", "gemma3")


# ---- checks: greedy tokens against transformers on the tiny models ---------------------------


def check_prompts(seed: int = 0) -> list[list[int]]:
    """12 prompts of 3-90 tokens: half start with one of two shared 40-token prefixes (prefix
    caching has full blocks to find), several pass gemma3's 16-token window."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 49000) for _ in range(40)] for _ in range(2)]
    lengths = [3, 9, 15, 17, 26, 33, 47, 50, 61, 70, 84, 90]
    prompts = []
    for i, n in enumerate(lengths):
        if i % 2 == 1 and n > 40:
            prompts.append(prefixes[i % 4 // 2] + [rng.randrange(100, 49000) for _ in range(n - 40)])
        else:
            prompts.append([rng.randrange(100, 49000) for _ in range(n)])
    return prompts


def hf_greedy(path: Path, prompts: list[list[int]], device: torch.device, max_new: int) -> list[list[int]]:
    """transformers' own greedy generation, one prompt at a time (no padding), fp32 on `device`."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    model = model.to(device).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new, eos_token_id=2, pad_token_id=2)  # fmt: skip
            out.append(gen[0, len(p) :].tolist())
    del model
    return out


def generate(llm: LLM, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_new))  # fmt: skip
    return [list(o.outputs[0].token_ids) for o in outs]


def pool_problems(llm: LLM) -> list[str]:
    """What tests/cluster/test_engine.py's assert_pool_empty checks, as messages."""
    st = llm.stats()
    problems = []
    if st.num_running or st.num_waiting or st.num_swapped:
        problems.append(f"requests left: {st.num_running} running, {st.num_waiting} waiting, "
                        f"{st.num_swapped} swapped")  # fmt: skip
    if st.free_blocks != st.num_blocks:
        problems.append(f"{st.num_blocks - st.free_blocks} KV blocks not back in the pool")
    if llm.engine.block_manager.seqs:
        problems.append("the block manager still maps sequences")
    bm = llm.engine.block_manager
    if len(bm.host_free) != bm.num_host_blocks:
        problems.append("host blocks not back in the host pool")
    return problems


def count_plans(llm: LLM) -> dict[str, int]:
    """Spy on the executor as tests/cluster/test_beam_search.py does: plans that swapped out/in."""
    counts = {"swap_out": 0, "swap_in": 0, "copies": 0}
    execute = llm.engine.executor.execute

    def spy(plan):
        counts["swap_out"] += bool(plan.swap_out)
        counts["swap_in"] += bool(plan.swap_in)
        counts["copies"] += len(plan.copies)
        return execute(plan)

    llm.engine.executor.execute = spy
    return counts


def spy_partial_prefill(llm: LLM) -> list[bool]:
    """As test_greedy_with_chunked_prefill_equals_transformers: per step, whether some running
    request's prompt was not yet fully computed (split across steps)."""
    seen: list[bool] = []
    step, scheduler = llm.engine.step, llm.engine.scheduler

    def spy():
        out = step()
        seen.append(any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running))
        return out

    llm.engine.step = spy
    return seen


def engine_on(llm: LLM, device: torch.device) -> list[str]:
    """The model and KV pool must live on `device` (a worker that fell back to the CPU is a failure)."""
    worker = llm.engine.executor.worker
    problems = []
    if worker.device.type != device.type:
        problems.append(f"worker on {worker.device}, wanted {device}")
    if worker.pool.k_caches[0].device.type != device.type:
        problems.append(f"KV pool on {worker.pool.k_caches[0].device}")
    param = next(worker.model.parameters())
    if param.device.type != device.type or param.dtype != torch.float32:
        problems.append(f"weights {param.dtype} on {param.device}")
    return problems


CaseFn = Callable[[Path, list[list[int]], list[list[int]]], tuple[list[str], dict]]


def case_batch(path, prompts, expected):
    llm = LLM(str(path), dtype="float32", num_gpu_blocks_override=256, max_model_len=256, block_size=16,
              enable_prefix_caching=False)  # fmt: skip
    problems = engine_on(llm, DEVICE)
    got = generate(llm, prompts, MAX_NEW)
    problems += mismatches(got, expected) + pool_problems(llm)
    return problems, {"steps": llm.stats().num_steps}


def case_prefix_caching(path, prompts, expected):
    llm = LLM(str(path), dtype="float32", num_gpu_blocks_override=256, max_model_len=256, block_size=8)
    problems = mismatches(generate(llm, prompts, MAX_NEW), expected)
    first_hits = llm.stats().prefix_cache_hits
    # again: every prompt's full blocks are cached now, and the tokens must not change
    problems += mismatches(generate(llm, prompts, MAX_NEW), expected)
    st = llm.stats()
    second_hits = st.prefix_cache_hits - first_hits
    if not second_hits > 0.5 * sum(len(p) for p in prompts):
        problems.append(f"second run hit only {second_hits} prompt tokens in the cache")
    return problems + pool_problems(llm), {"hits_first": first_hits, "hits_second": second_hits}


def case_chunked_prefill(path, prompts, expected):
    llm = LLM(str(path), dtype="float32", num_gpu_blocks_override=256, max_model_len=256, block_size=16,
              max_num_batched_tokens=24, enable_prefix_caching=False)  # fmt: skip
    seen = spy_partial_prefill(llm)
    problems = mismatches(generate(llm, prompts, MAX_NEW), expected)
    if not any(seen):
        problems.append("no prompt was split across steps")
    return problems + pool_problems(llm), {"steps_with_partial_prefill": sum(seen)}


def case_preemption(mode: str) -> CaseFn:
    def case(path, prompts, expected):
        # 20 blocks of every layer's KV: with hybrid KV (Gemma 3) a block holds one KV group's
        # layers, so the same bytes are 20 blocks per group (and the null block)
        from pagedserve.worker.kv_groups import kv_cache_groups
        from pagedserve.worker.loader import load_config

        groups = len(kv_cache_groups(load_config(path)))
        blocks = 20 * groups + (groups > 1)
        llm = LLM(str(path), dtype="float32", num_gpu_blocks_override=blocks, max_model_len=160, block_size=8,
                  preemption_mode=mode, swap_space=0.002, max_num_batched_tokens=160)  # fmt: skip
        counts = count_plans(llm)
        problems = mismatches(generate(llm, prompts, MAX_NEW), expected)
        st = llm.stats()
        if not st.num_preemptions > 0:
            problems.append("the pool is small enough that preemption must happen, and none did")
        if mode == "swap" and not (counts["swap_out"] > 0 and counts["swap_in"] > 0):
            problems.append(f"no swap out and back in: {counts}")
        return problems + pool_problems(llm), {"preemptions": st.num_preemptions, **counts}

    return case


CASES: dict[str, CaseFn] = {
    "batch": case_batch,
    "prefix_caching": case_prefix_caching,
    "chunked_prefill": case_chunked_prefill,
    "preempt_recompute": case_preemption("recompute"),
    "preempt_swap": case_preemption("swap"),
}


def mismatches(got: list[list[int]], expected: list[list[int]]) -> list[str]:
    bad = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    if len(got) != len(expected):
        return [f"{len(got)} outputs for {len(expected)} prompts"]
    return [f"prompt {i} ({len(PROMPTS[i])} tokens): got {got[i]}, transformers {expected[i]}" for i in bad]


PROMPTS = check_prompts()
DEVICE = torch.device("cpu")


def run_checks(models: Path) -> tuple[bool, dict]:
    backends: list[str] = []
    choose = kernels._backend

    def spy(t):
        name = choose(t)
        backends.append(name)
        return name

    kernels._backend = spy  # which kernel path the engine's attention and cache ops took
    results: dict[str, dict] = {}
    ok = True
    for kind in KINDS:
        path = models / kind
        t0 = time.perf_counter()
        expected = hf_greedy(path, PROMPTS, DEVICE, MAX_NEW)
        ref_s = time.perf_counter() - t0
        for name, case in CASES.items():
            backends.clear()
            t0 = time.perf_counter()
            try:
                problems, info = case(path, PROMPTS, expected)
            except Exception as e:  # a crash is a failed case, reported with its traceback
                traceback.print_exc()
                problems, info = [f"{type(e).__name__}: {e}"], {}
            want = os.environ.get("PAGEDSERVE_KERNELS", "auto")
            if want == "auto":
                want = "triton" if DEVICE.type == "cuda" else "cpu"
            if backends and want not in backends:
                problems.append(f"kernel path {sorted(set(backends))}, expected {want}")
            if not backends:
                problems.append("no kernel call seen")
            seconds = time.perf_counter() - t0
            passed = not problems
            ok &= passed
            results[f"{kind}/{name}"] = {"pass": passed, "seconds": round(seconds, 2), **info,
                                         "problems": problems[:5]}  # fmt: skip
            print(f"{'PASS' if passed else 'FAIL'} {kind:<7} {name:<18} {seconds:6.1f}s  "
                  + " ".join(f"{k}={v}" for k, v in info.items()), flush=True)
            for p in problems[:5]:
                print(f"    {p}", flush=True)
            gc.collect()
            if DEVICE.type == "cuda":
                torch.cuda.empty_cache()
        print(f"     {kind:<7} transformers reference {ref_s:.1f}s", flush=True)
    kernels._backend = choose
    passed = sum(r["pass"] for r in results.values())
    print(f"engine checks: {passed} passed, {len(results) - passed} failed", flush=True)
    return ok, {"checks": results, "checks_passed": passed, "checks_failed": len(results) - passed}


# ---- throughput: pagedserve against transformers' static batches -----------------------------


def save_random_model(config: LlamaConfig, folder: Path, tokenizer_dir: Path, dtype: torch.dtype) -> Path:
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, folder / name)
    del model
    return folder


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(length)] for _ in range(n)]


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def pagedserve_tok_s(path: Path, prompts: list[list[int]], warm: list[list[int]], out_len: int,
                     dtype: str, kv_bytes: int, max_batched: int) -> tuple[float, dict]:  # fmt: skip
    llm = LLM(str(path), dtype=dtype, max_model_len=len(prompts[0]) + out_len + 16, max_num_seqs=len(prompts),
              max_num_batched_tokens=max_batched, kv_cache_memory=kv_bytes)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    # warm-up on other prompts (no prefix-cache hits later): the kernels' specializations compile
    llm.generate([{"prompt_token_ids": p} for p in warm], SamplingParams(temperature=0, max_tokens=8,
                                                                        ignore_eos=True))  # fmt: skip
    llm.generate([{"prompt_token_ids": p[: 37 + i]} for i, p in enumerate(warm[:37])],
                 SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    before = llm.stats()
    sync()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    sync()
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == len(prompts) * out_len, f"{tokens} output tokens, wanted {len(prompts) * out_len}"
    st = llm.stats()
    split = {k: round(st.step_time[k] - before.step_time[k], 3) for k in st.step_time}
    info = {"seconds": round(elapsed, 3), "steps": st.num_steps - before.num_steps,
            "preemptions": st.num_preemptions - before.num_preemptions, "step_time_s": split,
            "kv_blocks": st.num_blocks}  # fmt: skip
    assert st.free_blocks == st.num_blocks, "every KV block must be back in the pool"
    llm.shutdown()
    del llm, outs
    gc.collect()
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()
    return tokens / elapsed, info


def transformers_tok_s(path: Path, prompts: list[list[int]], out_len: int, batch: int,
                       dtype: torch.dtype) -> tuple[float, dict]:  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).to(DEVICE).eval()
    pad = 2

    def run(model, group: list[list[int]], new: int) -> int:
        width = max(len(p) for p in group)
        ids = torch.full((len(group), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, p in enumerate(group):  # left padding
            ids[j, width - len(p) :] = torch.tensor(p)
            mask[j, width - len(p) :] = 1
        with torch.no_grad():
            out = model.generate(ids.to(DEVICE), attention_mask=mask.to(DEVICE), do_sample=False,
                                 max_new_tokens=new, min_new_tokens=new, pad_token_id=pad)  # fmt: skip
        return (out.shape[1] - width) * len(group)

    run(model, prompts[:batch], 8)  # warm-up
    sync()
    t0 = time.perf_counter()
    tokens = sum(run(model, prompts[i : i + batch], out_len) for i in range(0, len(prompts), batch))
    sync()
    elapsed = time.perf_counter() - t0
    assert tokens == len(prompts) * out_len, f"{tokens} output tokens, wanted {len(prompts) * out_len}"
    del model
    gc.collect()
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()
    return tokens / elapsed, {"seconds": round(elapsed, 3), "batch": batch}


def run_throughput(models: Path, quick: bool, deadline: float) -> dict:
    tok_dir = models / "smollm2_tok"
    smol = LlamaConfig.from_pretrained(tok_dir)
    smol.architectures = ["LlamaForCausalLM"]
    shapes = {"smollm2-135m-shape": smol}
    if quick:  # a CPU dry run: the same code on a small model and workload
        smol.num_hidden_layers, smol.hidden_size, smol.intermediate_size = 2, 192, 512
        smol.num_attention_heads, smol.num_key_value_heads, smol.head_dim = 3, 1, 64
        n, prompt_len, out_len, batch, dtype = 8, 32, 8, 4, torch.float32
    else:
        n, prompt_len, out_len, batch, dtype = 256, 256, 128, 64, torch.bfloat16
        shapes["llama-1b-shape"] = LlamaConfig(
            vocab_size=smol.vocab_size, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, architectures=["LlamaForCausalLM"],
        )  # fmt: skip
    prompts = random_prompts(n, prompt_len, seed=1)
    warm = random_prompts(n, prompt_len, seed=2)
    dtype_name = str(dtype).removeprefix("torch.")
    results: dict[str, dict] = {}
    tmp = Path(tempfile.mkdtemp(prefix="gpu_engine-"))
    try:
        for name, config in shapes.items():
            if time.perf_counter() > deadline:
                print(f"throughput {name}: skipped, out of time", flush=True)
                results[name] = {"skipped": "out of time"}
                continue
            t0 = time.perf_counter()
            path = save_random_model(config, tmp / name, tok_dir, dtype)
            ours, ours_info = pagedserve_tok_s(path, prompts, warm, out_len, dtype_name, 16 << 30 if not quick
                                               else 64 << 20, 8192 if not quick else 256)  # fmt: skip
            theirs, theirs_info = transformers_tok_s(path, prompts, out_len, batch, dtype)
            results[name] = {
                "pagedserve_tok_s": round(ours, 1), "transformers_tok_s": round(theirs, 1),
                "ratio": round(ours / theirs, 3), "requests": n, "prompt_len": prompt_len,
                "output_len": out_len, "dtype": dtype_name, "pagedserve": ours_info,
                "transformers": theirs_info, "wall_s": round(time.perf_counter() - t0, 1),
            }  # fmt: skip
            print(f"throughput {name} ({n} x {prompt_len} in / {out_len} out, {dtype_name}): pagedserve "
                  f"{ours:.1f} tok/s ({ours_info['seconds']:.2f}s, {ours_info['steps']} steps), transformers "
                  f"batch {batch} {theirs:.1f} tok/s ({theirs_info['seconds']:.2f}s); "
                  f"ratio {ours / theirs:.2f}",
                  flush=True)  # fmt: skip
            shutil.rmtree(path, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"throughput": results}


def build_gemma3_shape(models: Path) -> Path:
    """A random-weight bf16 model of Gemma 3 270M's shape in a temp folder, from
    ``models``/gemma3_270m (the converted config.json and tokenizer files, tokenizer.json gzipped)."""
    import gzip

    from transformers import AutoConfig

    src = models / "gemma3_270m"
    folder = Path(tempfile.mkdtemp(prefix="gemma3-270m-shape-"))
    config = AutoConfig.from_pretrained(src)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    del model
    for f in src.iterdir():
        if f.name.endswith(".gz"):
            (folder / f.name[:-3]).write_bytes(gzip.decompress(f.read_bytes()))
        elif f.name != "config.json":
            shutil.copy(f, folder / f.name)
    return folder


def run_hybrid(models: Path, quick: bool) -> dict:
    """Hybrid KV against every layer's blocks on one KV budget (benchmarks/throughput.py's
    ``hybrid_compare``): a random-weight model of Gemma 3 270M's shape (``gemma3_270m/``: its
    converted config.json and tokenizer, tokenizer.json gzipped), bf16, 128 requests with prompts
    of mean 4,000 tokens and outputs of mean 128, a budget of 65,536 tokens of every layer's K/V.
    ``quick``: the tiny Gemma 3 (window 16) on a small workload."""
    from argparse import Namespace

    from transformers import AutoConfig

    from benchmarks.throughput import hybrid_compare

    if quick:
        folder, dtype = models / "gemma3", "float32"
        ns = Namespace(hybrid_requests=6, hybrid_prompt=80, hybrid_output=8, hybrid_kv_tokens=512)
    else:
        folder, dtype = build_gemma3_shape(models), "bfloat16"
        ns = Namespace(hybrid_requests=128, hybrid_prompt=4000, hybrid_output=128, hybrid_kv_tokens=65536)
    ns.block_size, ns.dtype = 16, dtype
    vocab = AutoConfig.from_pretrained(folder).vocab_size
    return {"hybrid": hybrid_compare(folder, ns, vocab)}


def main() -> None:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=Path(".gpu/models"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--checks", action="store_true", help="run the greedy checks (default: both parts)")
    parser.add_argument("--throughput", action="store_true", help="run the throughput part")
    parser.add_argument("--quick", action="store_true", help="a small throughput workload (CPU dry run)")
    parser.add_argument("--hybrid", action="store_true",
                        help="hybrid KV against every layer's blocks (gemma3_270m/ in --models)")  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="start no further throughput model after this many seconds")  # fmt: skip
    parser.add_argument("--out", help="append one JSON line of figures here")
    args = parser.parse_args()
    start = time.perf_counter()
    DEVICE = torch.device(args.device)
    both = not (args.checks or args.throughput or args.hybrid)
    # exactness against transformers: fp32 matmuls in full precision (no TF32) on both sides
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    name = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "cpu"
    summary: dict[str, object] = {"device": name, "torch": torch.__version__}
    if DEVICE.type == "cuda":
        import transformers
        import triton

        summary.update(triton=triton.__version__, transformers=transformers.__version__)
    ok = True

    def write() -> None:
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(summary, default=str) + "\n")

    try:
        if args.checks or both:
            ok, figures = run_checks(args.models)
            summary.update(figures)
        if args.throughput or both:
            summary.update(run_throughput(args.models, args.quick, start + args.budget_s))
        if args.hybrid:
            summary.update(run_hybrid(args.models, args.quick))
    except BaseException:
        summary["error"] = traceback.format_exc()[-2000:]
        write()
        raise
    summary["wall_s"] = round(time.perf_counter() - start, 1)
    write()
    print(json.dumps(summary, default=str))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
