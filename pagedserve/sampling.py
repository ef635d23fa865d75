"""Sampling: per-request `SamplingParams` and a batched, vectorized `Sampler`.

One step samples one token per row of a logits matrix. Rows are described once per step by
`SamplingRow`s, gathered into a `SamplingBatch` that holds only the tensors the batch needs, so
an all-greedy batch costs one argmax. The order of operations follows vLLM:

    min_tokens mask -> repetition / frequency / presence penalties -> greedy rows: argmax
    -> temperature -> min_p -> top_k / top_p -> sample (inverse CDF, one uniform per row)

After temperature the sampled rows become unnormalized probabilities in place (exp of the
logit minus the row's max), so min_p, top_k and top_p are thresholds on one tensor, top_p
needs no logsumexp, and the CDF is one cumsum.

Logprobs are vLLM's default "raw" logprobs: log_softmax of the logits as the model produced
them, before penalties and temperature.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from itertools import chain
from typing import Any

import torch
from torch import Tensor

from pagedserve.kernels import argmax_rows, sample_rows

# Below this temperature a row is greedy (vLLM's _SAMPLING_EPS): dividing by it would overflow.
SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit and vLLM's default --max-logprobs
MAX_NUM_SEQUENCES = 128  # OpenAI's limit on n
MAX_STOP_SEQUENCES = 64  # stop strings, and stop token ids, per request
MAX_STOP_LENGTH = 1024  # characters of one stop string
EARLY_STOPPING = (False, True, "never")  # transformers' beam-search stopping rules
Device = torch.device | str
_SEED_MASK = 0xFFFF_FFFF_FFFF_FFFF  # torch.Generator.manual_seed takes 64-bit seeds
# top_p looks for its nucleus among the best 64, then 1024 tokens (a partial sort, topk); only
# rows whose nucleus is larger sort the whole vocabulary, ~10x slower than topk(1024) on CPU.
TOP_P_CANDIDATES = (64, 1024)
# Prompt logprobs run log_softmax over this many positions at a time: bounds the fp32 working set.
PROMPT_LOGPROBS_CHUNK = 512


class SamplingParamsError(ValueError):
    """A sampling parameter is invalid; `param` names it (OpenAI's 400 `param` field)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple[Any, ...]:
        # Ray pickles exceptions; the default reduce would call __init__ with the message only.
        return (type(self), (self.param, str(self)))


def _int(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingParamsError(name, f"{name} must be an integer, got {_short(value)}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"at least {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise SamplingParamsError(name, f"{name} must be {bounds}, got {value}")
    return value


def _float(name: str, value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            if math.isfinite(value):
                return float(value)
        except OverflowError:  # an int beyond float range
            pass
    raise SamplingParamsError(name, f"{name} must be a finite number, got {_short(value)}")


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise SamplingParamsError(name, f"{name} must be a boolean, got {_short(value)}")
    return value


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    """One request's sampling settings, with vLLM's names, defaults and ranges.

    Validated on construction: a bad value raises `SamplingParamsError` naming the parameter.
    Normalized on construction: `stop` becomes a list, `top_k=-1` becomes 0 (off), `seed=-1`
    becomes None. Treat instances as immutable (`dataclasses.replace` re-validates).
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # top-k logprobs per generated token (the sampled one always)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Beam search (vLLM's and transformers' names): width = beam_width, else best_of, else n.
    use_beam_search: bool = False
    beam_width: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        self.n = _int("n", self.n, 1, MAX_NUM_SEQUENCES)
        if self.best_of is not None:
            self.best_of = _int("best_of", self.best_of, self.n, MAX_NUM_SEQUENCES)
        self.temperature = _float("temperature", self.temperature)
        if self.temperature < 0:
            raise SamplingParamsError("temperature", f"temperature must be >= 0, got {self.temperature}")
        self.top_p = _float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = _int("top_k", self.top_k, -1)
        if self.top_k == -1:
            self.top_k = 0
        self.min_p = _float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            # msgpack's integer range, which is also the range torch.Generator.manual_seed takes.
            self.seed = None if _int("seed", self.seed, -(2**63), 2**64 - 1) == -1 else self.seed
        for name in ("presence_penalty", "frequency_penalty"):
            value = _float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise SamplingParamsError(name, f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise SamplingParamsError(
                "repetition_penalty", f"repetition_penalty must be > 0, got {self.repetition_penalty}"
            )
        self._normalize_stops()
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            _bool(name, getattr(self, name))
        if self.max_tokens is not None:
            self.max_tokens = _int("max_tokens", self.max_tokens, 1)
        self.min_tokens = _int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                "min_tokens", f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}"
            )
        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        _bool("use_beam_search", self.use_beam_search)
        self.length_penalty = _float("length_penalty", self.length_penalty)
        if self.early_stopping not in EARLY_STOPPING or not isinstance(self.early_stopping, (bool, str)):
            raise SamplingParamsError(
                "early_stopping",
                f"early_stopping must be true, false or \"never\", got {self.early_stopping!r}",
            )
        if self.beam_width is not None:
            self.beam_width = _int("beam_width", self.beam_width, 1, MAX_NUM_SEQUENCES)
        if self.use_beam_search:
            self._check_beam_search()
            return
        for name, neutral in (("beam_width", None), ("length_penalty", 1.0), ("early_stopping", False)):
            if getattr(self, name) != neutral:
                raise SamplingParamsError(name, f"{name} needs use_beam_search=true")
        if self.is_greedy and (self.n > 1 or (self.best_of or 1) > 1):
            # As vLLM: greedy copies would all be identical.
            param = "n" if self.n > 1 else "best_of"
            raise SamplingParamsError(param, f"{param} must be 1 when temperature is 0 (greedy sampling)")

    def _check_beam_search(self) -> None:
        """Beam search is deterministic: it refuses the options of sampling, naming the first one set."""
        width = self.width
        if self.beam_width is not None and self.best_of is not None and self.best_of != self.beam_width:
            raise SamplingParamsError(
                "best_of", f"best_of ({self.best_of}) and beam_width ({self.beam_width}) disagree; give one"
            )
        if self.n > width:
            raise SamplingParamsError("n", f"n ({self.n}) must be <= the beam width ({width})")
        refused = (
            ("temperature", not self.is_greedy, "0"), ("top_p", self.top_p != 1.0, "1"),
            ("top_k", self.top_k != 0, "-1 (off)"), ("min_p", self.min_p != 0.0, "0"),
            ("seed", self.seed is not None, "unset"),
            ("presence_penalty", self.presence_penalty != 0.0, "0"),
            ("frequency_penalty", self.frequency_penalty != 0.0, "0"),
            ("repetition_penalty", self.repetition_penalty != 1.0, "1"),
            ("min_tokens", self.min_tokens != 0, "0"),
            ("stop", bool(self.stop), "empty (use stop_token_ids)"),
            ("logprobs", self.logprobs is not None, "unset"),
            ("prompt_logprobs", self.prompt_logprobs is not None, "unset"),
        )  # fmt: skip
        for name, is_set, allowed in refused:
            if is_set:
                raise SamplingParamsError(name, f"beam search is deterministic: {name} must be {allowed}")

    @property
    def width(self) -> int:
        """The beam width of a beam search (beam_width, else best_of, else n); 1 otherwise."""
        if not self.use_beam_search:
            return 1
        return self.beam_width or self.best_of or self.n

    def _normalize_stops(self) -> None:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise SamplingParamsError(
                "stop", f"stop must be a string or a list of non-empty strings: {_short(stop)}"
            )
        # Every stop string is searched in each new piece of text and held back from streams:
        # bounded, generously (OpenAI allows 4).
        if len(stop) > MAX_STOP_SEQUENCES or any(len(s) > MAX_STOP_LENGTH for s in stop):
            raise SamplingParamsError(
                "stop", f"stop takes at most {MAX_STOP_SEQUENCES} strings of at most {MAX_STOP_LENGTH} "
                f"characters, got {len(stop)} of up to {max(map(len, stop))}"
            )  # fmt: skip
        self.stop = list(stop)
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)):
            raise SamplingParamsError("stop_token_ids", f"stop_token_ids must be a list, got {_short(ids)}")
        if len(ids) > MAX_STOP_SEQUENCES:
            raise SamplingParamsError(
                "stop_token_ids", f"stop_token_ids takes at most {MAX_STOP_SEQUENCES} ids, got {len(ids)}"
            )
        self.stop_token_ids = [_int("stop_token_ids", i, 0) for i in ids]

    @property
    def is_greedy(self) -> bool:
        """True when the row takes the argmax (temperature 0, or below `SAMPLING_EPS`)."""
        return self.temperature < SAMPLING_EPS

    def to_dict(self) -> dict[str, Any]:
        """Plain-typed dict (ints, floats, bools, strs, lists, None): msgpack- and JSON-safe."""
        return {f.name: _copy_plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SamplingParams:
        """Inverse of `to_dict`; missing keys take defaults, unknown keys raise SamplingParamsError."""
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known:
                raise SamplingParamsError(str(key), f"unknown sampling parameter {key!r}")
        return cls(**data)

    def for_sample(self, index: int) -> SamplingParams:
        """The params of parallel sample ``index`` of an n > 1 request: n=1 and, when seeded, seed + index."""
        seed = None if self.seed is None else self.seed + index
        return SamplingParams.from_dict({**self.to_dict(), "seed": seed, "n": 1, "best_of": None})


@dataclass(slots=True, kw_only=True)
class BeamSearchParams:
    """vLLM's ``LLM.beam_search`` parameters (plus transformers' ``early_stopping``)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # beam search here is deterministic: only 0
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def to_sampling_params(self) -> SamplingParams:
        """The engine's form; raises SamplingParamsError naming a bad value."""
        return SamplingParams(
            use_beam_search=True, beam_width=self.beam_width, n=self.beam_width, max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos, temperature=self.temperature, length_penalty=self.length_penalty,
            early_stopping=self.early_stopping, include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
        )  # fmt: skip


def beam_stop_token_ids(params: SamplingParams, eos_token_ids: Sequence[int]) -> frozenset[int]:
    """The tokens that end a beam: EOS (unless ignore_eos) and the request's stop_token_ids."""
    return frozenset(params.stop_token_ids) | frozenset(() if params.ignore_eos else eos_token_ids)


def num_beam_candidates(params: SamplingParams, eos_token_ids: Sequence[int]) -> int:
    """How many top tokens each beam's row returns: K = max(2, 1 + stop tokens) x width.

    With that many, at least W candidates of the group's best K do not stop (each stop token
    appears at most once per beam), so W beams always live on.
    """
    return max(2, 1 + len(beam_stop_token_ids(params, eos_token_ids))) * params.width


def _short(value: Any, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters: error messages never echo a huge input back."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _copy_plain(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value


def make_generator(seed: int, device: Device = "cpu") -> torch.Generator:
    """A row's own generator, seeded from the request's seed (any int; reduced to 64 bits).

    Create it once per sequence and pass it with every step's `SamplingRow`: the sampler
    advances it by exactly one draw per sampled token, so a seeded sequence's tokens do not
    depend on what else is in the batch.
    """
    generator = torch.Generator(device=device)
    generator.manual_seed(seed & _SEED_MASK)
    return generator


@dataclass(slots=True)
class SamplingRow:
    """One sequence's inputs to a sampling step.

    `generator` is required for a sampled (non-greedy) row whose params carry a seed.
    min_tokens is unmet while `len(output_token_ids) < params.min_tokens`; until then the
    row's stop_token_ids and (unless ignore_eos) the EOS ids cannot be sampled.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    generator: torch.Generator | None = None


@dataclass(slots=True)
class PenaltyInputs:
    """Penalties as flat (batch row, token id) pairs: the sampler gathers and scatters only the
    logits of tokens a row has seen, O(tokens) rather than O(rows x vocab)."""

    presence: Tensor | None  # [num_rows] float, 0 in rows without it; None when no row uses it
    frequency: Tensor | None
    repetition: Tensor | None  # [num_rows], 1 in rows without it
    output_rows: Tensor  # [T] int64: every output token of penalized rows, repeats kept
    output_ids: Tensor
    prompt_rows: Tensor  # prompt tokens, only of rows with a repetition penalty
    prompt_ids: Tensor


@dataclass(slots=True)
class RandomInputs:
    """Per-row settings of the sampled (non-greedy) rows (`rows`; None = every row)."""

    rows: Tensor | None
    num_rows: int
    temperature: Tensor | None  # [R] float; None when every row has temperature 1
    min_p: Tensor | None  # None when no row uses it
    top_k: Tensor | None  # [R] int64, 0 = off
    top_p: Tensor | None
    generators: list[tuple[int, torch.Generator]]  # (position in rows, generator) of seeded rows


@dataclass(slots=True)
class LogprobInputs:
    """Rows that asked for logprobs (`rows`; None = every row) and how many top entries each wants."""

    rows: Tensor | None
    row_ids: list[int]
    num_logprobs: list[int]
    max_num_logprobs: int


@dataclass(slots=True)
class SamplingBatch:
    """Everything one sampling step needs, as tensors; build it with `from_rows`.

    Each part is None when no row needs it, and the sampler then skips that stage entirely.
    """

    num_rows: int
    has_greedy: bool
    random: RandomInputs | None
    penalties: PenaltyInputs | None
    min_tokens_rows: Tensor | None  # flat (row, token id) pairs masked to -inf
    min_tokens_ids: Tensor | None
    logprobs: LogprobInputs | None

    @classmethod
    def from_rows(
        cls,
        rows: Sequence[SamplingRow],
        eos_token_ids: Sequence[int] = (),
        device: Device = "cpu",
    ) -> SamplingBatch:
        """Gather per-row inputs into tensors on `device`. A few list comprehensions over the
        rows, token lists concatenated into one tensor each, nothing built for an unused stage."""
        sampled = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        penalized = [i for i, row in enumerate(rows) if _uses_penalties(row.params)]
        unmet = [i for i, row in enumerate(rows) if len(row.output_token_ids) < row.params.min_tokens]
        with_logprobs = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        min_rows, min_ids = [], []
        for i in unmet:
            params = rows[i].params
            banned = [*params.stop_token_ids, *([] if params.ignore_eos else eos_token_ids)]
            min_rows += [i] * len(banned)
            min_ids += banned
        return cls(
            num_rows=len(rows),
            has_greedy=len(sampled) < len(rows),
            random=_random_inputs(rows, sampled, device) if sampled else None,
            penalties=_penalty_inputs(rows, penalized, device) if penalized else None,
            min_tokens_rows=_long(min_rows, device) if min_rows else None,
            min_tokens_ids=_long(min_ids, device) if min_rows else None,
            logprobs=_logprob_inputs(rows, with_logprobs, device) if with_logprobs else None,
        )


def _uses_penalties(params: SamplingParams) -> bool:
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0)


def _long(values: list[int], device: Device) -> Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _subset(rows: Sequence[SamplingRow], selected: list[int], device: Device) -> Tensor | None:
    # None stands for "every row": the sampler then works on the whole matrix without a gather.
    return None if len(selected) == len(rows) else _long(selected, device)


def _per_row(values: list[float], neutral: float, device: Device) -> Tensor | None:
    if all(v == neutral for v in values):
        return None  # the stage is skipped
    return torch.tensor(values, dtype=torch.float32, device=device)


def _random_inputs(rows: Sequence[SamplingRow], sampled: list[int], device: Device) -> RandomInputs:
    params = [rows[i].params for i in sampled]
    generators = []
    for position, i in enumerate(sampled):
        if params[position].seed is not None:
            if rows[i].generator is None:
                raise ValueError(f"row {i} has a seed but no generator (see make_generator)")
            generators.append((position, rows[i].generator))
    top_k = [p.top_k for p in params]
    return RandomInputs(
        rows=_subset(rows, sampled, device),
        num_rows=len(sampled),
        temperature=_per_row([p.temperature for p in params], 1.0, device),
        min_p=_per_row([p.min_p for p in params], 0.0, device),
        top_k=_long(top_k, device) if any(top_k) else None,
        top_p=_per_row([p.top_p for p in params], 1.0, device),
        generators=generators,
    )


def _penalty_inputs(rows: Sequence[SamplingRow], penalized: list[int], device: Device) -> PenaltyInputs:
    # Prompt tokens matter only to the repetition penalty.
    prompts = [
        rows[i].prompt_token_ids if rows[i].params.repetition_penalty != 1.0 else () for i in penalized
    ]
    outputs = [rows[i].output_token_ids for i in penalized]
    batch_rows = _long(penalized, device)
    return PenaltyInputs(
        presence=_per_row([row.params.presence_penalty for row in rows], 0.0, device),
        frequency=_per_row([row.params.frequency_penalty for row in rows], 0.0, device),
        repetition=_per_row([row.params.repetition_penalty for row in rows], 1.0, device),
        output_rows=batch_rows.repeat_interleave(_long([len(ids) for ids in outputs], device)),
        output_ids=_long(list(chain.from_iterable(outputs)), device),
        prompt_rows=batch_rows.repeat_interleave(_long([len(ids) for ids in prompts], device)),
        prompt_ids=_long(list(chain.from_iterable(prompts)), device),
    )


def _logprob_inputs(rows: Sequence[SamplingRow], selected: list[int], device: Device) -> LogprobInputs:
    num = [rows[i].params.logprobs or 0 for i in selected]
    return LogprobInputs(_subset(rows, selected, device), selected, num, max(num))


def _take(x: Tensor, rows: Tensor | None) -> Tensor:
    return x if rows is None else x[rows]


def _in_vocab(rows: Tensor, ids: Tensor, vocab_size: int) -> tuple[Tensor, Tensor]:
    # Tokenizers may know ids the lm_head does not produce (HF's processor drops them too).
    keep = ids < vocab_size
    return rows[keep], ids[keep]


def apply_min_tokens(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Set EOS / stop-token logits to -inf in rows whose min_tokens is unmet. In place."""
    if batch.min_tokens_rows is not None:
        rows, ids = _in_vocab(batch.min_tokens_rows, batch.min_tokens_ids, logits.shape[-1])
        logits[rows, ids] = float("-inf")
    return logits


def apply_penalties(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Apply vLLM's penalties in place to contiguous `logits` [batch.num_rows, vocab]:
    repetition (tokens of the prompt or output; positive logits divided, negative multiplied,
    as HF), then frequency (x output count) and presence (output token seen), as OpenAI."""
    pen = batch.penalties
    if pen is None:
        return logits
    vocab = logits.shape[-1]
    flat = logits.view(-1)
    out_rows, out_ids = _in_vocab(pen.output_rows, pen.output_ids, vocab)
    out_keys = out_rows * vocab + out_ids
    if pen.repetition is not None:
        prompt_rows, prompt_ids = _in_vocab(pen.prompt_rows, pen.prompt_ids, vocab)
        seen = torch.unique(torch.cat([prompt_rows * vocab + prompt_ids, out_keys]))
        values, factor = flat[seen], pen.repetition[seen // vocab]
        flat[seen] = torch.where(values > 0, values / factor, values * factor)
    if pen.frequency is not None:
        flat.index_add_(0, out_keys, -pen.frequency[out_rows])  # once per occurrence
    if pen.presence is not None:
        present = torch.unique(out_keys)
        flat.index_add_(0, present, -pen.presence[present // vocab])
    return logits


def apply_min_p(probs: Tensor, min_p: Tensor) -> Tensor:
    """Zero the entries below min_p x the row's largest. `probs` [rows, vocab] are unnormalized
    probabilities (any positive scale per row), min_p [rows]; in place. min_p = 0 keeps all."""
    return probs.masked_fill_(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)


def apply_top_k_top_p(probs: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """Keep each row's top_k entries (0 = off; ties kept), then the smallest set of those whose
    renormalized mass reaches top_p (1 = off), as HF's TopK then TopP warpers; zero the rest.

    `probs` [rows, vocab] are unnormalized probabilities, edited in place. Thresholds come from
    partial sorts (topk): a row is fully sorted only if its nucleus holds more than the last of
    `TOP_P_CANDIDATES` entries.
    """
    vocab = probs.shape[-1]
    k = torch.zeros(probs.shape[0], dtype=torch.int64, device=probs.device) if top_k is None else top_k
    k = k.masked_fill(k >= vocab, 0)  # a top_k that covers the vocabulary filters nothing
    p = torch.ones(probs.shape[0], device=probs.device) if top_p is None else top_p
    with_k = (k > 0).nonzero().squeeze(1)
    only_p = ((k == 0) & (p < 1)).nonzero().squeeze(1)
    if with_k.numel() == 0 and only_p.numel() == 0:
        return probs
    threshold = torch.zeros(probs.shape[0], 1, device=probs.device)
    if with_k.numel():
        threshold[with_k] = _top_k_threshold(_select(probs, with_k), k[with_k], p[with_k])
    if only_p.numel():
        threshold[only_p] = _top_p_threshold(_select(probs, only_p), p[only_p])
    return probs.masked_fill_(probs < threshold, 0.0)


def _select(x: Tensor, rows: Tensor) -> Tensor:
    # Every row selected: the tensor itself, without a gather copy.
    return x if rows.numel() == x.shape[0] else x[rows]


def _nucleus(candidates: Tensor, total: Tensor, top_p: Tensor) -> tuple[Tensor, Tensor]:
    """For candidates sorted descending and each row's total mass: the smallest value top_p
    keeps, and whether the candidates held the whole nucleus.

    An entry is kept while the mass before it is below top_p: HF's "ascending cumulative mass
    above 1 - top_p", counted from the other end.
    """
    share = candidates / total
    mass_before = share.cumsum(dim=-1) - share
    # top_p = 1 keeps everything: float error in the cumsum must not drop the tail.
    keep = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1)
    num_keep = keep.sum(dim=-1, keepdim=True).clamp_(min=1)
    covered = (mass_before[:, -1] + share[:, -1] >= top_p) | (top_p >= 1)
    return candidates.gather(1, num_keep - 1), covered


def _top_k_threshold(probs: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    candidates = probs.topk(int(top_k.max()), dim=-1).values
    kth = candidates.gather(1, top_k[:, None] - 1)
    candidates.masked_fill_(candidates < kth, 0.0)
    # top_p renormalizes over the top-k set, which the candidates hold entirely.
    threshold, _ = _nucleus(candidates, candidates.sum(dim=-1, keepdim=True), top_p)
    return torch.maximum(threshold, kth)


def _top_p_threshold(probs: Tensor, top_p: Tensor) -> Tensor:
    vocab = probs.shape[-1]
    total = probs.sum(dim=-1, keepdim=True)
    threshold = torch.full_like(total, float("inf"))  # every row is set by the last pass at the latest
    pending = torch.arange(probs.shape[0], device=probs.device)
    for width in (*[w for w in TOP_P_CANDIDATES if w < vocab], vocab):
        # Gathering most of the rows costs more (a fresh copy) than topk over the few others.
        gather = 2 * pending.numel() <= probs.shape[0]
        candidates = (probs[pending] if gather else probs).topk(width, dim=-1).values
        if not gather:
            candidates = candidates[pending]
        rows_threshold, covered = _nucleus(candidates, total[pending], top_p[pending])
        covered |= width == vocab  # the full sort holds every nucleus, whatever the float error
        threshold[pending[covered]] = rows_threshold[covered]
        pending = pending[~covered]
        if pending.numel() == 0:
            break
    return threshold


@dataclass(slots=True)
class TokenLogprobs:
    """Raw logprobs at one position: the chosen token's, its rank, and the best `k` (descending)."""

    token_id: int
    logprob: float
    rank: int  # 1 + the number of tokens with a strictly higher logprob
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class SamplerOutput:
    """One step's result; every list has one entry per batch row.

    The logprob fields are None in rows whose params.logprobs is None; `top_*` hold
    params.logprobs entries (possibly none), best first.
    """

    sampled_token_ids: list[int]
    logprobs: list[float | None]
    ranks: list[int | None]
    top_token_ids: list[list[int] | None]
    top_logprobs: list[list[float] | None]

    def token_logprobs(self, row: int) -> TokenLogprobs | None:
        """Row `row`'s logprobs as one record, or None when it did not ask for them."""
        if self.logprobs[row] is None:
            return None
        return TokenLogprobs(
            self.sampled_token_ids[row],
            self.logprobs[row],
            self.ranks[row],
            self.top_token_ids[row],
            self.top_logprobs[row],
        )


class Sampler:
    """Samples one token per row of a logits matrix, vectorized over the batch.

    Keeps two fp32 scratch matrices the size of the largest batch seen: on CPU a fresh 50 MB
    tensor costs ~17 ms of page faults, a copy into a kept one ~3 ms.
    """

    def __init__(self, generator: torch.Generator | None = None) -> None:
        # Unseeded rows share this generator (None: torch's default one for the logits' device).
        self.generator = generator
        self._scratch: dict[str, Tensor] = {}

    def __call__(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample from `logits` [batch.num_rows, vocab] (any float dtype; left unmodified).

        Greedy rows get the argmax of the penalized logits. A seeded row consumes exactly one
        uniform from its own generator per call, so its tokens do not depend on the batch.
        """
        if logits.dim() != 2 or logits.shape[0] != batch.num_rows:
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match {batch.num_rows} rows")
        raw_logprobs = None
        if batch.logprobs is not None:
            raw_logprobs = _take(logits, batch.logprobs.rows).float().log_softmax(dim=-1)
        work = logits
        if batch.random is not None or batch.penalties is not None or batch.min_tokens_rows is not None:
            # A private fp32 copy that every later stage edits in place.
            work = self._buffer("work", batch.num_rows, logits).copy_(logits)
            apply_penalties(apply_min_tokens(work, batch), batch)
        # Sampled rows overwrite their entries below; the argmax over all rows costs one pass.
        if batch.has_greedy:
            tokens = argmax_rows(work)
        else:
            tokens = torch.empty(batch.num_rows, dtype=torch.int64, device=logits.device)
        rnd = batch.random
        if rnd is not None:
            if rnd.rows is None:
                tokens = self._sample(work, rnd)
            else:
                rows = torch.index_select(work, 0, rnd.rows, out=self._buffer("sampled", rnd.num_rows, work))
                tokens[rnd.rows] = self._sample(rows, rnd)
        return _output(tokens, raw_logprobs, batch)

    def _buffer(self, name: str, num_rows: int, like: Tensor) -> Tensor:
        buffer = self._scratch.get(name)
        vocab = like.shape[-1]
        if (
            buffer is None
            or buffer.device != like.device
            or buffer.shape[1] != vocab
            or len(buffer) < num_rows
        ):
            buffer = self._scratch[name] = torch.empty(
                num_rows, vocab, dtype=torch.float32, device=like.device
            )
        return buffer[:num_rows]

    def _sample(self, logits: Tensor, rnd: RandomInputs) -> Tensor:
        uniforms = torch.rand(rnd.num_rows, generator=self.generator, device=logits.device)
        for position, generator in rnd.generators:
            uniforms[position] = torch.rand((), generator=generator, device=logits.device)
        if rnd.min_p is None and rnd.top_k is None and rnd.top_p is None:
            # temperature alone: cpu_ops.cpp's sample_rows draws from the same uniforms in one call
            tokens = sample_rows(logits, rnd.temperature, uniforms)
            if tokens is not None:
                return tokens
        # Every stage edits `logits` (scratch rows) in place; from the exp on they hold
        # probabilities up to a per-row scale (the row's largest is 1).
        if rnd.temperature is not None:
            logits.div_(rnd.temperature[:, None])
        probs = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
        if rnd.min_p is not None:
            apply_min_p(probs, rnd.min_p)
        if rnd.top_k is not None or rnd.top_p is not None:
            apply_top_k_top_p(probs, rnd.top_k, rnd.top_p)
        return sample_inverse_cdf(probs, uniforms)


def sample_inverse_cdf(probs: Tensor, uniforms: Tensor) -> Tensor:
    """Token ids drawn from unnormalized `probs` [rows, vocab] by inverting each row's CDF at
    `uniforms` [rows] in [0, 1). Zero entries are never drawn. Overwrites `probs` with the CDF.

    One uniform per row instead of one exponential per vocabulary entry (vLLM's race), which
    on CPU is the difference between ~0.05 s and ~0.5 s at 256 x 49152.
    """
    cdf = probs.cumsum_(dim=-1)
    total = cdf[:, -1:]
    # Strictly below the total, so the search always lands on an entry of positive mass.
    target = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def _output(tokens: Tensor, raw_logprobs: Tensor | None, batch: SamplingBatch) -> SamplerOutput:
    n = batch.num_rows
    out = SamplerOutput(tokens.tolist(), [None] * n, [None] * n, [None] * n, [None] * n)
    lp = batch.logprobs
    if lp is None or raw_logprobs is None:
        return out
    chosen = raw_logprobs.gather(1, _take(tokens, lp.rows)[:, None])
    ranks = ((raw_logprobs > chosen).sum(dim=-1) + 1).tolist()
    chosen_list = chosen.squeeze(1).tolist()
    top_ids: list[list[int]] = [[] for _ in lp.row_ids]
    top_values: list[list[float]] = [[] for _ in lp.row_ids]
    if lp.max_num_logprobs > 0:
        values, ids = raw_logprobs.topk(lp.max_num_logprobs, dim=-1)
        top_ids, top_values = ids.tolist(), values.tolist()
    for j, (row, k) in enumerate(zip(lp.row_ids, lp.num_logprobs)):
        out.logprobs[row] = chosen_list[j]
        out.ranks[row] = ranks[j]
        out.top_token_ids[row] = top_ids[j][:k]
        out.top_logprobs[row] = top_values[j][:k]
    return out


def compute_prompt_logprobs(
    logits: Tensor, prompt_token_ids: Sequence[int], num_logprobs: int
) -> list[TokenLogprobs | None]:
    """Raw logprobs of each prompt token given the tokens before it, as vLLM's prompt_logprobs.

    `logits[i]` is the model's output at prompt position i (it predicts token i + 1); at least
    len(prompt_token_ids) - 1 rows are needed and later rows are ignored. Entry 0 is None (the
    first token has no context); entry i holds token i's logprob, rank and the top
    `num_logprobs` entries at position i - 1.
    """
    num_scored = len(prompt_token_ids) - 1
    if num_scored > 0 and logits.shape[0] < num_scored:
        raise ValueError(f"need logits for {num_scored} prompt positions, got {logits.shape[0]}")
    result: list[TokenLogprobs | None] = [None]
    targets = torch.as_tensor(list(prompt_token_ids[1:]), dtype=torch.int64, device=logits.device)
    for start in range(0, max(num_scored, 0), PROMPT_LOGPROBS_CHUNK):
        stop = min(start + PROMPT_LOGPROBS_CHUNK, num_scored)
        logprobs = logits[start:stop].float().log_softmax(dim=-1)
        chosen = logprobs.gather(1, targets[start:stop, None])
        ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
        top_ids: list[list[int]] = [[] for _ in range(stop - start)]
        top_values: list[list[float]] = [[] for _ in range(stop - start)]
        if num_logprobs > 0:
            values, ids = logprobs.topk(num_logprobs, dim=-1)
            top_ids, top_values = ids.tolist(), values.tolist()
        tokens = targets[start:stop].tolist()
        for j, value in enumerate(chosen.squeeze(1).tolist()):
            result.append(TokenLogprobs(tokens[j], value, ranks[j], top_ids[j], top_values[j]))
    return result
