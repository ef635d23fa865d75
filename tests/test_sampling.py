"""Tests for pagedserve/sampling.py against oracles it does not share code with: torch's argmax
and log_softmax, Hugging Face's logits processors, OpenAI's penalty formula and a chi-square
test of the sampled distribution. Every random source is seeded, so nothing here can flake."""

from __future__ import annotations

import pickle
from collections import Counter
from collections.abc import Callable

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    LogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from pagedserve import sampling
from pagedserve.sampling import (
    MAX_LOGPROBS,
    Sampler,
    SamplingBatch,
    SamplingParams,
    SamplingParamsError,
    SamplingRow,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    compute_prompt_logprobs,
    make_generator,
)

# Deterministic example sets: a failure reproduces, a pass cannot turn into a flake.
FIXED = settings(max_examples=40, deadline=None, derandomize=True)


def random_logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def sample(
    logits: torch.Tensor, rows: list[SamplingRow], seed: int = 0, eos: tuple[int, ...] = ()
) -> list[int]:
    batch = SamplingBatch.from_rows(rows, eos_token_ids=eos)
    return Sampler(torch.Generator().manual_seed(seed))(logits, batch).sampled_token_ids


def hf_rows(warper: Callable[[int], LogitsProcessor], logits: torch.Tensor) -> torch.Tensor:
    # HF's warpers take one setting for the whole batch: apply them row by row.
    return torch.cat([warper(i)(None, logits[i : i + 1].clone()) for i in range(logits.shape[0])])


def unnormalized(logits: torch.Tensor) -> torch.Tensor:
    # What the filters receive in the sampler: exp(logit - row max), probabilities up to a scale.
    return (logits - logits.amax(dim=-1, keepdim=True)).exp()


def assert_same_filter(ours: torch.Tensor, theirs: torch.Tensor, probs: torch.Tensor) -> None:
    """`ours` (zeros for dropped tokens) keeps exactly the tokens HF left finite, unchanged."""
    kept = torch.isfinite(theirs)
    assert torch.equal(ours > 0, kept)
    assert torch.equal(ours[kept], probs[kept])


# --- SamplingParams --------------------------------------------------------------------------


def test_defaults_match_vllm() -> None:
    assert SamplingParams().to_dict() == {
        "n": 1,
        "best_of": None,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "seed": None,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "stop": [],
        "stop_token_ids": [],
        "include_stop_str_in_output": False,
        "ignore_eos": False,
        "max_tokens": 16,
        "min_tokens": 0,
        "logprobs": None,
        "prompt_logprobs": None,
        "skip_special_tokens": True,
        "use_beam_search": False,  # vLLM's old beam-search fields (and transformers' early_stopping)
        "beam_width": None,
        "length_penalty": 1.0,
        "early_stopping": False,
    }
    assert not SamplingParams().is_greedy and SamplingParams(temperature=0).is_greedy


def test_normalization() -> None:
    p = SamplingParams(stop="###", top_k=-1, seed=-1, temperature=0, max_tokens=None)
    assert p.stop == ["###"] and p.top_k == 0 and p.seed is None and p.is_greedy
    assert isinstance(p.temperature, float)


@pytest.mark.parametrize(
    ("param", "value"),
    [
        ("n", 0),
        ("n", 1.5),
        ("best_of", 0),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", -2),
        ("top_k", 2.0),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("presence_penalty", 2.01),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", float("inf")),
        ("stop", [""]),
        ("stop", [3]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", 5),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("logprobs", MAX_LOGPROBS + 1),
        ("logprobs", -1),
        ("logprobs", True),
        ("prompt_logprobs", 21),
        ("ignore_eos", "yes"),
        ("seed", "42"),
        ("seed", 2**64),
        ("temperature", 10**400),
    ],
)
def test_invalid_param_is_named(param: str, value: object) -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**{param: value})
    assert info.value.param == param
    assert param in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"n": 2, "temperature": 0.0}, "n"),
        ({"best_of": 2, "temperature": 0.0}, "best_of"),
    ],
)
def test_invalid_combinations(kwargs: dict, param: str) -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_error_survives_pickling() -> None:
    # Ray ships exceptions between processes by pickling them.
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(top_p=2.0)
    copy = pickle.loads(pickle.dumps(info.value))
    assert copy.param == "top_p" and str(copy) == str(info.value)


def test_from_dict_rejects_unknown_keys() -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams.from_dict({"temprature": 0.5})
    assert info.value.param == "temprature"


@FIXED
@given(st.data())
def test_msgpack_round_trip(data: st.DataObject) -> None:
    temperature = data.draw(st.sampled_from([0.0, 0.5, 1.0]))
    n = 1 if temperature == 0 else data.draw(st.integers(1, 4))
    params = SamplingParams(
        n=n,
        temperature=temperature,
        top_p=data.draw(st.floats(0.01, 1.0)),
        top_k=data.draw(st.integers(-1, 100)),
        min_p=data.draw(st.floats(0.0, 1.0)),
        seed=data.draw(st.none() | st.integers(0, 2**64 - 1)),
        presence_penalty=data.draw(st.floats(-2.0, 2.0)),
        frequency_penalty=data.draw(st.floats(-2.0, 2.0)),
        repetition_penalty=data.draw(st.floats(0.1, 3.0)),
        stop=data.draw(st.lists(st.text(min_size=1, max_size=5), max_size=3)),
        stop_token_ids=data.draw(st.lists(st.integers(0, 50000), max_size=3)),
        ignore_eos=data.draw(st.booleans()),
        max_tokens=data.draw(st.none() | st.integers(8, 4096)),
        min_tokens=data.draw(st.integers(0, 8)),
        logprobs=data.draw(st.none() | st.integers(0, MAX_LOGPROBS)),
        prompt_logprobs=data.draw(st.none() | st.integers(0, MAX_LOGPROBS)),
    )
    wire = msgpack.unpackb(msgpack.packb(params.to_dict()))
    assert SamplingParams.from_dict(wire) == params
    assert pickle.loads(pickle.dumps(params)) == params


# --- greedy and the fast path ----------------------------------------------------------------


def test_greedy_is_argmax_and_builds_nothing() -> None:
    logits = random_logits(64, 5000, seed=1)
    rows = [SamplingRow(SamplingParams(temperature=0.0), [1, 2], [3]) for _ in range(64)]
    batch = SamplingBatch.from_rows(rows, eos_token_ids=[2])
    assert batch.random is None and batch.penalties is None and batch.logprobs is None
    assert batch.min_tokens_rows is None
    assert Sampler()(logits, batch).sampled_token_ids == logits.argmax(-1).tolist()


def test_default_rows_skip_every_filter() -> None:
    batch = SamplingBatch.from_rows([SamplingRow(SamplingParams()) for _ in range(8)])
    rnd = batch.random
    assert rnd is not None and rnd.rows is None
    assert (rnd.temperature, rnd.min_p, rnd.top_k, rnd.top_p) == (None, None, None, None)
    assert batch.penalties is None and not batch.has_greedy


def test_mixed_greedy_rows_are_argmax_of_penalized_logits() -> None:
    logits = random_logits(6, 300, seed=2)
    rows = [
        SamplingRow(SamplingParams(temperature=0.0 if i % 2 else 0.8, repetition_penalty=1.5), [5], [7, 7])
        for i in range(6)
    ]
    batch = SamplingBatch.from_rows(rows)
    penalized = apply_penalties(logits.clone(), batch)
    tokens = Sampler()(logits, batch).sampled_token_ids
    assert [tokens[i] for i in (1, 3, 5)] == penalized[[1, 3, 5]].argmax(-1).tolist()


def test_logits_are_not_modified() -> None:
    logits = random_logits(4, 100, seed=3)
    before = logits.clone()
    rows = [
        SamplingRow(
            SamplingParams(temperature=0.5, top_k=5, top_p=0.9, min_p=0.1, frequency_penalty=1.0), [], [1]
        ),
        SamplingRow(SamplingParams(), [], []),
        SamplingRow(SamplingParams(temperature=0.0, min_tokens=2), [], []),
        SamplingRow(SamplingParams(repetition_penalty=2.0), [4], [4]),
    ]
    sample(logits, rows, eos=(0,))
    sample(logits, rows[1:2] * 4)  # all rows sampled: the in-place CDF must work on a copy
    assert torch.equal(logits, before)


def test_half_precision_logits() -> None:
    logits = random_logits(4, 200, seed=4).to(torch.bfloat16)
    rows = [
        SamplingRow(SamplingParams(temperature=0.0)),
        SamplingRow(SamplingParams(top_k=3, logprobs=2)),
    ] * 2
    out = Sampler()(logits, SamplingBatch.from_rows(rows))
    assert out.sampled_token_ids[0] == int(logits[0].argmax())
    assert out.logprobs[1] == pytest.approx(
        logits[1].float().log_softmax(-1)[out.sampled_token_ids[1]].item()
    )


# --- filters against Hugging Face's processors -----------------------------------------------


@FIXED
@given(seed=st.integers(0, 2**31), k=st.integers(1, 300))
def test_top_k_matches_hf(seed: int, k: int) -> None:
    # Steep logits: the tail's mass is below float resolution, which must not cut the top-k set.
    logits = random_logits(4, 256, seed, scale=8.0)
    ks = torch.tensor([k, 1, 0, 256])  # 0 and >= vocab: off
    ours = apply_top_k_top_p(unnormalized(logits), ks, None)
    theirs = torch.cat(
        [
            TopKLogitsWarper(int(ks[i]))(None, logits[i : i + 1].clone()) if ks[i] else logits[i : i + 1]
            for i in range(4)
        ]
    )
    assert_same_filter(ours, theirs, unnormalized(logits))


@pytest.mark.parametrize("candidates", [(64, 1024), (4,), ()])  # (): every row fully sorted
@pytest.mark.parametrize("scale", [0.3, 3.0])  # flat and peaked distributions
def test_top_p_matches_hf(monkeypatch: pytest.MonkeyPatch, candidates: tuple[int, ...], scale: float) -> None:
    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", candidates)
    logits = random_logits(32, 2048, seed=5, scale=scale)
    ps = torch.linspace(0.05, 1.0, 32)
    ours = apply_top_k_top_p(logits.softmax(-1), None, ps)
    assert_same_filter(ours, hf_rows(lambda i: TopPLogitsWarper(float(ps[i])), logits), logits.softmax(-1))


@pytest.mark.parametrize("candidates", [(64, 1024), ()])
def test_top_p_just_below_one_keeps_the_tail(
    monkeypatch: pytest.MonkeyPatch, candidates: tuple[int, ...]
) -> None:
    # The float32 cumsum of a flat row never reaches 1 - 6e-8: the full sort must still decide.
    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", candidates)
    logits = random_logits(4, 4096, seed=14, scale=0.01)
    probs = apply_top_k_top_p(logits.softmax(-1), None, torch.full((4,), 1.0 - 2**-24))
    assert (probs > 0).sum(-1).min() > 4000


@FIXED
@given(seed=st.integers(0, 2**31), k=st.integers(0, 80), p=st.floats(0.05, 1.0))
def test_top_k_then_top_p_matches_hf(seed: int, k: int, p: float) -> None:
    logits = random_logits(4, 512, seed)
    ks, ps = torch.tensor([k, k // 3 + 1, k, 0]), torch.tensor([p, p, 1.0, p])
    ours = apply_top_k_top_p(unnormalized(logits), ks, ps)

    def hf(i: int, row: torch.Tensor) -> torch.Tensor:
        if ks[i]:
            row = TopKLogitsWarper(int(ks[i]))(None, row)
        return TopPLogitsWarper(float(ps[i]))(None, row)

    theirs = torch.cat([hf(i, logits[i : i + 1].clone()) for i in range(4)])
    assert_same_filter(ours, theirs, unnormalized(logits))


@FIXED
@given(seed=st.integers(0, 2**31), min_p=st.floats(0.0, 1.0))
def test_min_p_matches_hf(seed: int, min_p: float) -> None:
    logits = random_logits(3, 512, seed)
    mins = torch.tensor([min_p, 0.0, 0.05])
    ours = apply_min_p(logits.softmax(-1), mins)
    assert_same_filter(ours, hf_rows(lambda i: MinPLogitsWarper(float(mins[i])), logits), logits.softmax(-1))


def penalty_rows(seed: int, num_rows: int, vocab: int, **params: float) -> list[SamplingRow]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num_rows):
        prompt = torch.randint(0, vocab, (int(torch.randint(0, 40, (), generator=g)),), generator=g).tolist()
        # Outputs draw from a small range, so tokens repeat and overlap the prompt.
        output = torch.randint(0, 20, (int(torch.randint(0, 30, (), generator=g)),), generator=g).tolist()
        rows.append(SamplingRow(SamplingParams(**params), prompt, output))
    return rows


@FIXED
@given(seed=st.integers(0, 2**31), penalty=st.floats(0.2, 3.0))
def test_repetition_penalty_matches_hf(seed: int, penalty: float) -> None:
    logits = random_logits(5, 300, seed)
    rows = penalty_rows(seed, 5, 300, repetition_penalty=penalty)
    ours = apply_penalties(logits.clone(), SamplingBatch.from_rows(rows))
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    for i, row in enumerate(rows):
        ids = torch.tensor([list(row.prompt_token_ids) + list(row.output_token_ids)], dtype=torch.long)
        expected = hf(ids, logits[i : i + 1].clone()) if ids.numel() else logits[i : i + 1]
        torch.testing.assert_close(ours[i : i + 1], expected)


@FIXED
@given(seed=st.integers(0, 2**31), presence=st.floats(-2.0, 2.0), frequency=st.floats(-2.0, 2.0))
def test_presence_frequency_match_openai_formula(seed: int, presence: float, frequency: float) -> None:
    logits = random_logits(5, 300, seed)
    rows = penalty_rows(seed, 5, 300, presence_penalty=presence, frequency_penalty=frequency)
    ours = apply_penalties(logits.clone(), SamplingBatch.from_rows(rows))
    for i, row in enumerate(rows):
        # OpenAI: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence, c = output counts.
        expected = logits[i].clone()
        for token, count in Counter(row.output_token_ids).items():
            expected[token] -= count * frequency + presence
        torch.testing.assert_close(ours[i], expected)


def test_penalties_compose_repetition_first() -> None:
    logits = random_logits(1, 50, seed=6)
    row = SamplingRow(
        SamplingParams(repetition_penalty=1.7, presence_penalty=0.5, frequency_penalty=0.3), [1, 2], [2, 2, 3]
    )
    ours = apply_penalties(logits.clone(), SamplingBatch.from_rows([row]))
    expected = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([[1, 2, 2, 2, 3]]), logits.clone())[0]
    expected[2] -= 2 * 0.3 + 0.5
    expected[3] -= 1 * 0.3 + 0.5
    torch.testing.assert_close(ours[0], expected)


def test_out_of_vocab_history_tokens_are_ignored() -> None:
    logits = random_logits(1, 10, seed=7)
    row = SamplingRow(SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0), [3, 99], [12, 3])
    ours = apply_penalties(logits.clone(), SamplingBatch.from_rows([row]))
    changed = (ours != logits).nonzero()[:, 1].tolist()
    assert changed == [3]


# --- sampled distribution --------------------------------------------------------------------

# Chi-square critical values at p = 0.001 by degrees of freedom.
CHI2_CRITICAL = {3: 16.27, 5: 20.52, 7: 24.32, 9: 27.88, 11: 31.26}


def chi_square(tokens: list[int], probs: torch.Tensor) -> tuple[float, int]:
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double()
    expected = probs.double() * len(tokens)
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a filtered token"
    stat = ((counts[support] - expected[support]) ** 2 / expected[support]).sum().item()
    return stat, int(support.sum()) - 1


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.8])
def test_distribution_matches_softmax_over_temperature(temperature: float) -> None:
    logits = random_logits(1, 10, seed=8, scale=1.0)
    rows = [SamplingRow(SamplingParams(temperature=temperature))] * 40_000
    tokens = sample(logits.expand(len(rows), -1), rows, seed=9)
    probs = TemperatureLogitsWarper(temperature)(None, logits.clone())[0].softmax(-1)
    stat, dof = chi_square(tokens, probs)
    assert stat < CHI2_CRITICAL[dof], stat


def test_distribution_after_all_filters_matches_hf_chain() -> None:
    # Evenly spaced logits, shuffled: each filter below removes a few tokens (16 -> 11 -> 9 -> 6).
    logits = torch.linspace(2.0, -2.0, 16)[torch.randperm(16, generator=torch.Generator().manual_seed(0))][
        None
    ]
    params = SamplingParams(temperature=0.7, min_p=0.02, top_k=9, top_p=0.9)
    rows = [SamplingRow(params)] * 40_000
    tokens = sample(logits.expand(len(rows), -1), rows, seed=11)
    # vLLM's order: temperature, min_p, top_k, top_p.
    x = logits.clone()
    for warper in (
        TemperatureLogitsWarper(0.7),
        MinPLogitsWarper(0.02),
        TopKLogitsWarper(9),
        TopPLogitsWarper(0.9),
    ):
        x = warper(None, x)
    stat, dof = chi_square(tokens, x[0].softmax(-1))
    assert dof == 5 and stat < CHI2_CRITICAL[dof], stat


@FIXED
@given(seed=st.integers(0, 2**31), k=st.integers(0, 20), p=st.floats(0.05, 1.0), min_p=st.floats(0.0, 0.5))
def test_sampled_tokens_survive_hf_filters(seed: int, k: int, p: float, min_p: float) -> None:
    logits = random_logits(8, 64, seed)
    params = SamplingParams(temperature=0.9, top_k=k, top_p=p, min_p=min_p)
    tokens = sample(logits, [SamplingRow(params)] * 8, seed=seed)
    x = TemperatureLogitsWarper(0.9)(None, logits.clone())
    x = MinPLogitsWarper(min_p)(None, x)
    if k:
        x = TopKLogitsWarper(k)(None, x)
    x = TopPLogitsWarper(p)(None, x)
    assert all(torch.isfinite(x[i, t]) for i, t in enumerate(tokens))


# --- seeds -----------------------------------------------------------------------------------


def seeded_run(seed: int, neighbours: int, position: int, steps: int = 40, vocab: int = 4096) -> list[int]:
    """Tokens of one seeded top-p row over `steps`, placed among `neighbours` other rows."""
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=seed, frequency_penalty=0.2)
    mine = SamplingRow(params, [1, 2, 3], [], make_generator(seed))
    others = [
        SamplingRow(SamplingParams(temperature=0.0)),
        SamplingRow(SamplingParams()),
        SamplingRow(SamplingParams(temperature=1.3, top_k=20, seed=7), [], [], make_generator(7)),
        SamplingRow(SamplingParams(min_p=0.1, repetition_penalty=1.2, logprobs=3), [4, 5], []),
    ]
    rows = [others[i % len(others)] for i in range(neighbours)]
    rows.insert(position, mine)
    sampler = Sampler()  # unseeded rows use torch's global generator: it must not matter
    tokens = []
    for step in range(steps):
        logits = random_logits(len(rows), vocab, seed=1000 + step, scale=2.0)
        logits[position] = random_logits(1, vocab, seed=step, scale=2.0)[0]  # the same input every run
        token = sampler(logits, SamplingBatch.from_rows(rows, eos_token_ids=[0])).sampled_token_ids[position]
        mine.output_token_ids = [*mine.output_token_ids, token]
        tokens.append(token)
    return tokens


def test_seeded_row_is_independent_of_the_batch() -> None:
    alone = seeded_run(seed=1234, neighbours=0, position=0)
    assert seeded_run(seed=1234, neighbours=0, position=0) == alone
    assert seeded_run(seed=1234, neighbours=15, position=9) == alone
    assert seeded_run(seed=1234, neighbours=15, position=0) == alone
    assert seeded_run(seed=4321, neighbours=0, position=0) != alone


def test_seeded_row_needs_its_generator() -> None:
    with pytest.raises(ValueError, match="generator"):
        SamplingBatch.from_rows([SamplingRow(SamplingParams(seed=1))])
    # A greedy row ignores its seed.
    SamplingBatch.from_rows([SamplingRow(SamplingParams(seed=1, temperature=0.0))])


def test_make_generator_is_deterministic() -> None:
    a, b = make_generator(2**64 + 5), make_generator(5)
    assert torch.equal(torch.rand(8, generator=a), torch.rand(8, generator=b))


# --- min_tokens ------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_masks_eos_and_stop_tokens(temperature: float) -> None:
    eos, stop = 2, 5
    logits = torch.zeros(4, 10)
    logits[:, eos] = 50.0
    logits[:, stop] = 40.0
    params = SamplingParams(temperature=temperature, min_tokens=3, stop_token_ids=[stop])
    ignoring = SamplingParams(temperature=temperature, min_tokens=3, stop_token_ids=[stop], ignore_eos=True)
    rows = [
        SamplingRow(params, [], [7]),  # unmet: neither eos nor stop
        SamplingRow(params, [], [7, 7, 7]),  # met: eos wins
        SamplingRow(ignoring, [], [7]),  # ignore_eos: eos is an ordinary token, the stop id is masked
        SamplingRow(SamplingParams(temperature=temperature), [], []),
    ]
    tokens = sample(logits, rows, eos=(eos,))
    assert tokens[0] not in (eos, stop)
    assert tokens[1:] == [eos, eos, eos]


# --- logprobs --------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_ranks_and_top_k() -> None:
    logits = random_logits(5, 1000, seed=12)
    rows = [
        SamplingRow(SamplingParams(temperature=0.5, repetition_penalty=1.5, top_k=50, logprobs=5), [1], [2]),
        SamplingRow(
            SamplingParams(temperature=0.0, presence_penalty=2.0, logprobs=20), [], [int(logits[1].argmax())]
        ),
        SamplingRow(SamplingParams()),
        SamplingRow(SamplingParams(logprobs=0)),
        SamplingRow(SamplingParams(temperature=0.0, logprobs=1)),
    ]
    out = Sampler(torch.Generator().manual_seed(0))(logits, SamplingBatch.from_rows(rows))
    expected = torch.log_softmax(logits, dim=-1)
    for i, row in enumerate(rows):
        k = row.params.logprobs
        if k is None:
            assert out.logprobs[i] is None and out.top_token_ids[i] is None and out.token_logprobs(i) is None
            continue
        token = out.sampled_token_ids[i]
        assert out.logprobs[i] == pytest.approx(expected[i, token].item(), abs=1e-6)
        order = expected[i].argsort(descending=True).tolist()
        assert out.ranks[i] == order.index(token) + 1
        assert out.top_token_ids[i] == order[:k]
        torch.testing.assert_close(torch.tensor(out.top_logprobs[i]), expected[i, order[:k]])
        record = out.token_logprobs(i)
        assert record is not None and record.token_id == token and record.rank == out.ranks[i]
    assert out.ranks[4] == 1
    assert out.ranks[1] > 1  # the penalty moved greedy off the raw argmax


@pytest.mark.parametrize("chunk", [512, 3])
def test_prompt_logprobs(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    monkeypatch.setattr(sampling, "PROMPT_LOGPROBS_CHUNK", chunk)
    prompt = [5, 17, 3, 99, 42, 0, 8]
    logits = random_logits(len(prompt), 128, seed=13)  # the last row predicts past the prompt
    result = compute_prompt_logprobs(logits, prompt, 4)
    assert len(result) == len(prompt) and result[0] is None
    expected = torch.log_softmax(logits, dim=-1)
    for i in range(1, len(prompt)):
        entry = result[i]
        assert entry is not None and entry.token_id == prompt[i]
        assert entry.logprob == pytest.approx(expected[i - 1, prompt[i]].item(), abs=1e-6)
        order = expected[i - 1].argsort(descending=True).tolist()
        assert entry.rank == order.index(prompt[i]) + 1
        assert entry.top_token_ids == order[:4]
    assert compute_prompt_logprobs(logits[:0], [5], 2) == [None]


def test_stop_lists_are_bounded_and_errors_do_not_echo_huge_inputs() -> None:
    from pagedserve.sampling import MAX_STOP_LENGTH, MAX_STOP_SEQUENCES

    SamplingParams(stop=["x"] * MAX_STOP_SEQUENCES, stop_token_ids=list(range(MAX_STOP_SEQUENCES)))
    for kwargs, param in [
        ({"stop": ["x"] * (MAX_STOP_SEQUENCES + 1)}, "stop"),
        ({"stop": ["y" * (MAX_STOP_LENGTH + 1)]}, "stop"),
        ({"stop_token_ids": list(range(MAX_STOP_SEQUENCES + 1))}, "stop_token_ids"),
        ({"stop": [1] * 100_000}, "stop"),
        ({"max_tokens": "9" * 100_000}, "max_tokens"),
    ]:
        with pytest.raises(SamplingParamsError) as err:
            SamplingParams(**kwargs)
        assert err.value.param == param and len(str(err.value)) < 300
