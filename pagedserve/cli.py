"""``pagedserve serve | generate``: the OpenAI-compatible server on Ray Serve, and one-shot generation.

Flags are vLLM's names and map 1:1 onto the config dataclasses (``pagedserve/config.py``); a flag
left out takes the dataclass default.

    pagedserve serve                          # the default model on http://127.0.0.1:8000
    pagedserve serve /models/llama --num-replicas 2 --routing prefix --api-key $KEY
    pagedserve generate "The capital of France is" --max-tokens 16 --temperature 0
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from pagedserve.cluster.executor import init_ray
from pagedserve.config import (
    CONTROL_PLANE_POLICIES,
    DTYPES,
    PLACEMENT_STRATEGIES,
    PLAN_TRANSPORTS,
    PREEMPTION_MODES,
    PROXY_LOCATIONS,
    ROUTING_POLICIES,
    ConfigError,
    ServeConfig,
)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from "200MiB", "1.5G", "4096" (K/M/G/T are powers of 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GiB, 1048576)")
    number, unit, _ = match.groups()
    return int(float(number) * 1024 ** " kmgt".index(unit.lower() or " "))


def _engine_flags(parser: argparse.ArgumentParser) -> None:
    # default=None everywhere: an absent flag takes the config dataclass's default.
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="HF folder, GGUF file or cached hub id (default: SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--served-model-name", default=None, help="the model id clients send")
    parser.add_argument("--dtype", choices=DTYPES, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--kv-cache-memory", type=parse_size, default=None, help="KV pool size, e.g. 2GiB")
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None)
    parser.add_argument(
        "--swap-space", type=float, default=None, help="GiB of host memory for swapped blocks"
    )
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument(
        "--disable-hybrid-kv-cache-manager", action="store_true", default=None,
        help="sliding-window layers keep every block too (one block table for all layers)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--preemption-mode", choices=PREEMPTION_MODES, default=None)
    parser.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default=None)
    parser.add_argument("--max-beam-width", type=int, default=None, help="widest beam search allowed (16)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=None)
    parser.add_argument(
        "--placement-group-strategy", choices=PLACEMENT_STRATEGIES, default=None,
        help="where a replica's ranks go (default STRICT_PACK: one node; PACK may span nodes)",
    )  # fmt: skip
    parser.add_argument("--distributed-executor-backend", choices=("ray", "mp"), default=None)
    parser.add_argument(
        "--plan-transport", choices=PLAN_TRANSPORTS, default=None,
        help="how each step's plan reaches the ranks (default socket)",
    )  # fmt: skip
    parser.add_argument(
        "--step-timeout-s", type=float, default=None,
        help="a tensor-parallel step not done by then fails its requests and rebuilds the group (300)",
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="LLM serving on Ray with PagedAttention")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible API on Ray Serve")
    _engine_flags(serve)
    serve.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="HTTP port (default 8000)")
    serve.add_argument("--num-replicas", type=int, default=None, help="engine replicas (default 1)")
    serve.add_argument(
        "--routing", choices=ROUTING_POLICIES, default=None, help="request routing (default prefix)"
    )
    serve.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="per replica; past it requests get 503 with Retry-After (default 256)",
    )
    serve.add_argument(
        "--api-key",
        default=os.environ.get("PAGEDSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $PAGEDSERVE_API_KEY)",
    )
    serve.add_argument(
        "--admin-token",
        default=os.environ.get("PAGEDSERVE_ADMIN_TOKEN"),
        help="the token of /dashboard and /admin/api (default: $PAGEDSERVE_ADMIN_TOKEN, else one is "
        "generated and printed at start-up)",
    )
    serve.add_argument(
        "--proxy-location", choices=PROXY_LOCATIONS, default=None,
        help="where Ray Serve answers HTTP: Direct (default on the private Ray: the ingress replica itself, "
        "no proxy hop), EveryNode (default with --address), HeadOnly (several raylets on one box)",
    )
    serve.add_argument(
        "--replica-resources",
        type=json.loads,
        default=None,
        help='Ray custom resources each engine replica reserves, as JSON: \'{"pagedserve_engine": 1}\' '
        "places replicas only on nodes started with that resource",
    )
    serve.add_argument(
        "--address", default=None, help="join this Ray cluster (default: start a private local Ray)"
    )
    serve.add_argument(
        "--control-plane-policy", choices=CONTROL_PLANE_POLICIES, default=None,
        help="the private Ray's control plane (GCS, Serve's controller, the dashboards, log monitor; not "
        "the replicas) at Linux's SCHED_IDLE, running where the engine leaves a core free (idle, the "
        "default), or as started (normal)",
    )  # fmt: skip
    serve.add_argument(
        "--engine-process", action=argparse.BooleanOptionalAction, default=None,
        help="run a one-rank engine's scheduler and model in a process of their own beside the replica "
        "(default; --no-engine-process: on a thread of the replica)",
    )  # fmt: skip
    limits = serve.add_argument_group("request limits (400 past them; 413 / 408 for the body)")
    limits.add_argument("--max-body-bytes", type=parse_size, default=None, help="request body size (8MiB)")
    limits.add_argument("--body-timeout-s", type=float, default=None, help="time to send the body (30)")
    limits.add_argument("--max-n", type=int, default=None, help="n, best_of, beam width (128)")
    limits.add_argument("--max-logprobs", type=int, default=None, help="logprobs, top_logprobs (20)")
    limits.add_argument("--max-output-tokens", type=int, default=None, help="max_tokens (the context's room)")
    limits.add_argument("--max-prompt-tokens", type=int, default=None, help="prompt tokens (context - 1)")

    gen = commands.add_parser("generate", help="generate offline in this process and print the text")
    gen.add_argument("--prompt", "-p", action="append", required=True, help="a prompt (repeat for a batch)")
    _engine_flags(gen)
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument(
        "--sampling-seed", type=int, default=None, help="the request's seed (--seed is the engine's)"
    )
    gen.add_argument("-n", type=int, default=1, help="samples per prompt (the best beams with --beam-width)")
    gen.add_argument("--beam-width", type=int, default=None, help="beam search of this width")
    gen.add_argument("--length-penalty", type=float, default=1.0, help="beam search's length penalty")
    return parser


SERVE_ONLY = ("command",)
GENERATE_ONLY = (
    "command",
    "prompt",
    "chat",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "sampling_seed",
    "n",
    "beam_width",
    "length_penalty",
)


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The ServeConfig of parsed ``serve`` flags; flags left out take the dataclasses' defaults."""
    from pagedserve.router.app import serve_config_from_flags

    flags = {k: v for k, v in vars(args).items() if k not in SERVE_ONLY and v is not None}
    if "proxy_location" not in flags and flags.get("address") is None:
        flags["proxy_location"] = "Direct"  # our own Ray: the ingress replica serves HTTP itself
    return serve_config_from_flags(flags)


def _check_port_free(host: str, port: int) -> None:
    """ConfigError where host:port cannot be bound (taken by another server), before Ray starts:
    else Serve fails the ingress deployment (Direct) or its proxy later, in a traceback."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as exc:
            raise ConfigError(f"--port {port}: cannot listen on {host}:{port} ({exc.strerror})") from exc


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def serve_main(args: argparse.Namespace) -> int:
    """Run the server until SIGINT or SIGTERM, then take it down (all of Serve on a private Ray,
    only this application on a joined cluster)."""
    import ray
    from ray import serve

    from pagedserve.router.app import APP_NAME, deploy, private_ray_env, served_model_name

    config = serve_config_from_args(args)
    if config.address is None:  # our own Ray: its HTTP server binds here (say so now if it cannot),
        _check_port_free(config.host, config.port)  # and its processes inherit this environment
        os.environ.update(private_ray_env(config))
    # refuse an architecture we do not implement, or a size its heads cannot split, before
    # anything starts (not as a shape error in a replica that is loading weights)
    from pagedserve.worker.loader import check_tensor_parallel, load_config, resolve_model
    from pagedserve.worker.models import UnsupportedModel, get_model_class

    hf_config = load_config(resolve_model(config.engine.model.model))
    try:
        get_model_class(hf_config)
    except UnsupportedModel as exc:
        raise ConfigError(str(exc)) from exc
    check_tensor_parallel(hf_config, config.engine.parallel.tensor_parallel_size)
    generated = not config.admin_token
    if generated:
        from pagedserve.router.dashboard import new_admin_token

        config.admin_token = new_admin_token()
    signal.signal(signal.SIGTERM, _interrupt)
    temp_dir = None
    try:
        temp_dir = init_ray(config.address)
        signal.signal(signal.SIGTERM, _interrupt)  # after ray.init, which may install its own
        deploy(config)
        if temp_dir is not None and config.control_plane_policy == "idle":
            from pagedserve.cluster.control_plane import idle_control_plane

            demoted = idle_control_plane()
            print(f"pagedserve: Ray's and Serve's control plane ({len(demoted)} processes) at SCHED_IDLE",
                  flush=True)  # fmt: skip
        print(f"pagedserve: serving {served_model_name(config.engine)!r} at http://{config.host}:{config.port}/v1"
              " (Ctrl-C to stop)", flush=True)  # fmt: skip
        print(f"pagedserve: admin dashboard at http://{config.host}:{config.port}/dashboard"
              + (f" (admin token: {config.admin_token})" if generated else " (token: --admin-token)"),
              flush=True)  # fmt: skip
        threading.Event().wait()
    except KeyboardInterrupt:
        print("pagedserve: shutting down", flush=True)
    finally:
        if ray.is_initialized():
            if temp_dir is None:
                serve.delete(APP_NAME)
            else:
                serve.shutdown()
            ray.shutdown()
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)
    return 0


def generate_main(args: argparse.Namespace) -> int:
    from pagedserve import LLM, SamplingParams
    from pagedserve.sampling import SamplingParamsError

    flags = {k: v for k, v in vars(args).items() if k not in GENERATE_ONLY and v is not None}
    try:
        beam = {}
        if args.beam_width is not None:
            beam = {"use_beam_search": True, "beam_width": args.beam_width,
                    "length_penalty": args.length_penalty}  # fmt: skip
        params = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed,
                                **beam)  # fmt: skip
    except SamplingParamsError as exc:
        raise ConfigError(str(exc)) from exc
    llm = LLM(**flags)
    try:
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
        else:
            outputs = llm.generate(list(args.prompt), params)
    except SamplingParamsError as exc:  # a limit of the engine (--max-beam-width, say)
        raise ConfigError(str(exc)) from exc
    finally:
        llm.shutdown()
    for out in outputs:
        for sample in out.outputs:
            print(sample.text, flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return serve_main(args) if args.command == "serve" else generate_main(args)
    except ConfigError as exc:
        print(f"pagedserve: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
