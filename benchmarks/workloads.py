"""Request workloads shared by the benchmarks: ShareGPT-like lengths and Mooncake-format traces."""

from __future__ import annotations

import gzip
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[1].parent / "shared/workloads/mooncake_conversation_trace.jsonl.gz"
)


@dataclass(slots=True)
class Request:
    prompt_token_ids: list[int]
    output_len: int
    arrival_s: float = 0.0
    hash_ids: tuple[int, ...] = ()


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)


def sharegpt_like(
    num_requests: int,
    *,
    max_model_len: int = 2048,
    mean_input: float = 161.0,
    mean_output: float = 338.0,
    vocab_size: int = 32000,
    shared_prefix_len: int = 0,
    num_prefixes: int = 1,
    seed: int = 0,
) -> list[Request]:
    """Lengths from lognormals with the PagedAttention paper's ShareGPT means (input ~161, output ~338).

    With ``shared_prefix_len`` every prompt starts with one of ``num_prefixes`` common prefixes
    (a system prompt, few-shot examples), as in a chat deployment.
    """
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab_size) for _ in range(shared_prefix_len)] for _ in range(num_prefixes)]
    out = []
    for i in range(num_requests):
        n_in = max(4, min(int(_lognormal(rng, mean_input, 1.0)), max_model_len // 2))
        n_out = max(1, min(int(_lognormal(rng, mean_output, 0.9)), max_model_len - n_in - shared_prefix_len))
        prompt = prefixes[i % num_prefixes] + [rng.randrange(vocab_size) for _ in range(n_in)]
        out.append(Request(prompt, n_out))
    return out


def long_prompts(num_requests: int, *, mean_input: int, mean_output: int, seed: int,
                 vocab_size: int = 32000) -> list[Request]:
    """Long-context requests: prompts lognormal around ``mean_input`` tokens (sigma 0.5, within
    [mean/4, 3 mean]), outputs lognormal around ``mean_output`` (sigma 0.9, at least 1)."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        n_in = int(min(max(rng.lognormvariate(math.log(mean_input) - 0.125, 0.5), mean_input / 4),
                       3 * mean_input))  # fmt: skip
        n_out = max(1, int(rng.lognormvariate(math.log(mean_output) - 0.405, 0.9)))
        out.append(Request([rng.randrange(vocab_size) for _ in range(n_in)], n_out))
    return out


def mooncake_trace(
    path: str | Path = DEFAULT_TRACE,
    *,
    num_requests: int | None = None,
    block_tokens: int = 16,
    vocab_size: int = 32000,
    time_scale: float = 1.0,
) -> list[Request]:
    """Replay a Mooncake-format trace with every 512-token block scaled down to ``block_tokens``.

    Each hash id becomes a seeded random run of token ids, so requests that share leading hash ids
    share exactly those prefixes; lengths (input and output) scale by block_tokens / 512.
    """
    scale = block_tokens / 512
    opener = gzip.open if str(path).endswith(".gz") else open
    blocks: dict[int, list[int]] = {}
    out = []
    with opener(path, "rt") as f:
        for line in f:
            if num_requests is not None and len(out) >= num_requests:
                break
            rec = json.loads(line)
            tokens: list[int] = []
            for h in rec["hash_ids"]:
                if h not in blocks:
                    rng = random.Random(h * 7919 + 17)
                    blocks[h] = [rng.randrange(vocab_size) for _ in range(block_tokens)]
                tokens.extend(blocks[h])
            n_in = max(1, min(len(tokens), math.ceil(rec["input_length"] * scale)))
            n_out = max(1, math.ceil(rec["output_length"] * scale))
            out.append(
                Request(tokens[:n_in], n_out, rec["timestamp"] / 1000 * time_scale, tuple(rec["hash_ids"]))
            )
    return out
