"""Beam search in the engine against transformers' own ``generate(num_beams=W)``, token for token,
with the beams' blocks shared (forks, copy-on-write) and the group preempted as a whole."""

from __future__ import annotations

import functools
import random
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve import LLM, BeamSearchParams, SamplingParams
from pagedserve.cluster.beam import BeamSearch
from pagedserve.cluster.block_manager import RequestTooLong
from pagedserve.cluster.engine import run_to_completion
from pagedserve.plan import StepPlan
from pagedserve.sampling import SamplingParamsError
from tests.cluster.test_block_manager import check_invariants

MAX_NEW = 14
SETTINGS = [(1.0, False), (0.5, True), (2.0, "never"), (-1.0, False)]  # (length_penalty, early_stopping)


@functools.lru_cache(maxsize=2)
def hf_model(path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


def hf_beams(path: Path, prompt: list[int], width: int, n: int, max_new: int, eos: list[int],
             length_penalty: float = 1.0, early_stopping: bool | str = False) -> list[list[int]]:  # fmt: skip
    """transformers' beam search for one prompt: the n best beams' generated tokens (up to and
    including the stop token that ended each; transformers pads after it)."""
    with torch.no_grad():
        out = hf_model(str(path)).generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, num_beams=width, num_return_sequences=n, max_new_tokens=max_new,
            eos_token_id=eos, pad_token_id=eos[0], length_penalty=length_penalty,
            early_stopping=early_stopping,
        )  # fmt: skip
    beams = []
    for row in out:
        tokens = row[len(prompt) :].tolist()
        ends = [i for i, t in enumerate(tokens) if t in eos]
        beams.append(tokens[: ends[0] + 1] if ends else tokens)
    return beams


def random_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(rng.randrange(5, 40))] for _ in range(n)]


def liked_stop_tokens(path: Path, prompts: list[list[int]], width: int) -> list[int]:
    """Per prompt, a token transformers' beams like at their third position: as a stop token it ends
    some beams early (the random tiny model practically never produces its EOS)."""
    stops = []
    for p in prompts:
        beams = hf_beams(path, p, width, width, 4, [2])
        stops.append(Counter(b[2] for b in beams).most_common(1)[0][0])
    return stops


def beam_params(width: int, stop: int, length_penalty: float, early_stopping: bool | str,
                n: int | None = None) -> SamplingParams:  # fmt: skip
    return SamplingParams(
        use_beam_search=True, beam_width=width, n=n or width, temperature=0, max_tokens=MAX_NEW,
        length_penalty=length_penalty, early_stopping=early_stopping, stop_token_ids=[stop],
    )  # fmt: skip


def check_beams_equal_transformers(llm: LLM, path: Path, prompts: list[list[int]], stops: list[int],
                                   width: int, settings=SETTINGS) -> None:  # fmt: skip
    for lp, es in settings:
        n = max(1, width // 2)
        params = [beam_params(width, s, lp, es, n) for s in stops]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        for p, s, out in zip(prompts, stops, outs):
            expected = hf_beams(path, p, width, n, MAX_NEW, [2, s], lp, es)
            assert [o.token_ids for o in out.outputs] == expected, (width, lp, es)
            for o in out.outputs:
                assert o.finish_reason == ("stop" if o.token_ids[-1] in (2, s) else "length")


def assert_pool_empty(llm: LLM) -> None:
    st = llm.stats()
    assert st.num_running == st.num_waiting == st.num_swapped == 0
    assert st.free_blocks == st.num_blocks, "every KV block must be back in the pool"
    assert llm.engine.block_manager.seqs == {}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(5, seed=1)


@pytest.mark.parametrize("width", [2, 4, 8])
def test_beams_equal_transformers_with_prefix_caching(tiny_engine_model, prompts, width):
    """Widths 2, 4, 8; n = W/2 best beams; four length-penalty / early-stopping settings; beams that
    end early on a stop token; all prompts in one batch, prefix caching on (the default)."""
    llm = LLM(str(tiny_engine_model), dtype="float32", max_model_len=128, block_size=4,
              num_gpu_blocks_override=400)  # fmt: skip
    stops = liked_stop_tokens(tiny_engine_model, prompts, width)
    check_beams_equal_transformers(llm, tiny_engine_model, prompts, stops, width)
    st = llm.stats()
    # The beams shared blocks: fewer distinct blocks than table entries, on every step summed.
    assert 0 < st.beam_block_steps_physical < st.beam_block_steps_logical
    assert_pool_empty(llm)


def count_plans(llm: LLM) -> Counter:
    """Spy on the executor: how many plans swapped blocks out and in, and carried copy-on-write copies."""
    counts: Counter = Counter()
    execute = llm.engine.executor.execute

    def spy(plan):
        counts["swap_out"] += bool(plan.swap_out)
        counts["swap_in"] += bool(plan.swap_in)
        counts["copies"] += len(plan.copies)
        counts["tokens"] += plan.num_tokens
        return execute(plan)

    llm.engine.executor.execute = spy
    return counts


@pytest.mark.parametrize(
    "mode,prefix_caching", [("recompute", True), ("recompute", False), ("swap", True)]
)
def test_beams_equal_transformers_under_preemption(tiny_engine_model, prompts, mode, prefix_caching):
    """A pool of 60 blocks of 4 tokens for five groups of 8 beams: groups are preempted whole
    (swapped, or recomputed with the beams re-sharing their prefix) and still match transformers."""
    llm = LLM(str(tiny_engine_model), dtype="float32", max_model_len=64, block_size=4,
              num_gpu_blocks_override=60, preemption_mode=mode, max_num_batched_tokens=64,
              enable_prefix_caching=prefix_caching)  # fmt: skip
    counts = count_plans(llm)
    stops = liked_stop_tokens(tiny_engine_model, prompts, 8)
    check_beams_equal_transformers(llm, tiny_engine_model, prompts, stops, 8, SETTINGS[:2])
    assert llm.stats().num_preemptions > 0
    assert counts["copies"] > 0  # beams wrote into shared partly filled blocks
    if mode == "swap":
        assert counts["swap_out"] > 0 and counts["swap_in"] > 0
    assert_pool_empty(llm)


def test_recompute_re_prefills_the_prompt_once(tiny_engine_model):
    """A recomputed group's beams come back sharing their common prefix with the first beam (no
    prefix cache to lean on): the prompt is computed again once, not once per beam."""
    llm = LLM(str(tiny_engine_model), dtype="float32", max_model_len=128, block_size=4,
              num_gpu_blocks_override=400, enable_prefix_caching=False)  # fmt: skip
    engine = llm.engine
    prompt = list(range(1000, 1030))
    engine.add_request("g", {"prompt_token_ids": prompt}, beam_params(4, 2, 1.0, False))
    while not (engine._beam_groups and len(engine._groups["g"].beam_group.beams) == 4):
        engine.step()
    for _ in range(3):
        engine.step()
    group = engine._groups["g"].beam_group
    counts = count_plans(llm)
    scheduler = engine.scheduler
    plan_before = scheduler.num_preemptions
    victim = group.beams[-1]
    scheduler._preempt(victim, StepPlan([]), {})
    assert scheduler.num_preemptions == plan_before + 4  # the whole group went
    assert all(b.status.value == "waiting" for b in group.beams)
    outputs = {b.request_id: len(b.output_token_ids) for b in group.beams}
    engine.step()  # re-admission: every beam comes back in this one step
    recomputed = counts["tokens"]
    per_beam_tail = max(outputs.values()) + 4  # its own outputs plus at most one partial block
    assert recomputed <= len(prompt) + 4 * per_beam_tail < 4 * len(prompt)
    run_to_completion(engine, ["g"])
    assert_pool_empty(llm)


def test_block_accounting_every_step(tiny_engine_model, prompts):
    """After every step: each block's reference count is the number of tables holding it, the
    blocks in use are exactly the union of the live beams' tables, and sharing keeps that union
    smaller than the tables' total; at the end every block is free."""
    llm = LLM(str(tiny_engine_model), dtype="float32", max_model_len=128, block_size=4,
              num_gpu_blocks_override=400)  # fmt: skip
    engine = llm.engine
    for i, p in enumerate(prompts[:3]):
        engine.add_request(f"g{i}", {"prompt_token_ids": p}, beam_params(4, 2, 1.0, False))
    shared_steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        bm = engine.block_manager
        check_invariants(bm)
        union, total = set(), 0
        for root in engine._groups.values():
            for beam in root.beam_group.beams:
                if beam.request_id in bm:
                    union.update(bm.block_table(beam.request_id))
                    total += len(bm.block_table(beam.request_id))
        in_use = {b.block_id for b in bm.blocks if b.ref_count > 0}
        assert in_use == union
        shared_steps += len(union) < total
    assert shared_steps > 0
    assert_pool_empty(llm)


def test_llm_beam_search_in_vllms_shape(tiny_engine_model):
    """LLM.beam_search(prompts, BeamSearchParams): beam_width sequences per prompt, best first,
    tokens and text holding the prompt too (as vLLM's), equal to generate(use_beam_search=True)."""
    llm = LLM(str(tiny_engine_model), dtype="float32", max_model_len=128)
    prompt = random_prompts(1, seed=3)[0]
    [result] = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=3, max_tokens=6))
    [same] = llm.generate([{"prompt_token_ids": prompt}],
                          SamplingParams(use_beam_search=True, n=3, temperature=0, max_tokens=6))  # fmt: skip
    assert len(result.sequences) == 3
    tok = llm.get_tokenizer()
    for seq, o in zip(result.sequences, same.outputs):
        assert seq.tokens == prompt + o.token_ids
        assert seq.text == tok.decode(seq.tokens, skip_special_tokens=True)
        assert seq.cum_logprob == pytest.approx(o.cumulative_logprob)
    scores = [s.cum_logprob / len(s.tokens[len(prompt) :]) for s in result.sequences]
    assert scores == sorted(scores, reverse=True)
    assert [s.tokens[len(prompt):] for s in result.sequences] == hf_beams(
        tiny_engine_model, prompt, 3, 3, 6, [2]
    )


def test_abort_mid_search_frees_every_block(tiny_engine_model, prompts):
    llm = LLM(str(tiny_engine_model), dtype="float32", max_model_len=128, block_size=4)
    engine = llm.engine
    engine.add_request("g", {"prompt_token_ids": prompts[0]}, beam_params(4, 2, 1.0, False, n=2))
    for _ in range(4):
        engine.step()
    assert len(engine._groups["g"].beam_group.beams) == 4
    out = engine.abort_request("g")
    assert out.finished and len(out.outputs) == 2
    assert [(o.finish_reason, len(o.token_ids)) for o in out.outputs] == [("abort", 4)] * 2  # a token a step
    engine.step()  # the workers hear which beams to forget
    assert_pool_empty(llm)


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"beam_width": 0}, "beam_width"),
        ({"beam_width": 2, "n": 3}, "n"),
        ({"best_of": 2, "beam_width": 3}, "best_of"),
        ({"beam_width": 2, "temperature": 0.7}, "temperature"),
        ({"beam_width": 2, "top_p": 0.9}, "top_p"),
        ({"beam_width": 2, "top_k": 5}, "top_k"),
        ({"beam_width": 2, "seed": 1}, "seed"),
        ({"beam_width": 2, "stop": ["x"]}, "stop"),
        ({"beam_width": 2, "logprobs": 1}, "logprobs"),
        ({"beam_width": 2, "repetition_penalty": 1.2}, "repetition_penalty"),
        ({"beam_width": 2, "early_stopping": "sometimes"}, "early_stopping"),
    ],
)
def test_bad_beam_search_params_name_the_parameter(kwargs, param):
    base = {"use_beam_search": True, "temperature": 0}
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**{**base, **kwargs})
    assert err.value.param == param


def test_beam_options_need_beam_search():
    for kwargs, param in [({"length_penalty": 0.5}, "length_penalty"),
                          ({"early_stopping": True}, "early_stopping"), ({"beam_width": 2}, "beam_width")]:
        with pytest.raises(SamplingParamsError) as err:
            SamplingParams(temperature=0, **kwargs)
        assert err.value.param == param
    # n > 1 at temperature 0 is refused for sampling, but is the point of beam search
    assert SamplingParams(use_beam_search=True, n=4, temperature=0).width == 4
    assert SamplingParams(use_beam_search=True, n=2, best_of=4, temperature=0).width == 4


def test_width_limit_and_pool_size_are_checked_at_add(tiny_engine_model):
    llm = LLM(str(tiny_engine_model), dtype="float32", max_model_len=64, block_size=4,
              num_gpu_blocks_override=40, max_beam_width=4)  # fmt: skip
    with pytest.raises(SamplingParamsError) as err:
        llm.generate([[5, 6, 7]], SamplingParams(use_beam_search=True, best_of=5, temperature=0))
    assert err.value.param == "best_of" and "--max-beam-width 4" in str(err.value)
    # 4 beams x 60 tokens of their own cannot fit 40 blocks of 4 tokens
    with pytest.raises(RequestTooLong, match="beam search of width 4"):
        llm.generate([[5, 6, 7]], SamplingParams(use_beam_search=True, n=4, temperature=0, max_tokens=60))
    assert_pool_empty(llm)


def test_transformers_stopping_rules_on_a_fixed_table():
    """advance() on hand-made candidates: a stop among the first W becomes a hypothesis scored
    sum / length ** penalty; early_stopping=True ends once W are done; the heuristic ends the
    search when the best live beam cannot beat the worst hypothesis."""
    params = SamplingParams(use_beam_search=True, beam_width=2, temperature=0, max_tokens=10,
                            early_stopping=True)  # fmt: skip
    search = BeamSearch(params, eos_token_ids=[2], max_tokens=10)
    assert search.num_candidates == 4  # max(2, 1 + one stop token) x 2
    live = search.advance([[]], [0.0], [([2, 7, 8, 9], [-0.5, -1.0, -2.0, -3.0])])
    assert [(c.parent, c.token_id) for c in live] == [(0, 7), (0, 8)]
    assert [(h.token_ids, h.score) for h in search.hypotheses] == [([2], -0.5)]
    live = search.advance([[7], [8]], [-1.0, -2.0], [([2, 5, 6, 4], [-0.1, -1.0, -2.0, -3.0]),
                                                     ([2, 5, 6, 4], [-0.1, -0.2, -2.0, -3.0])])  # fmt: skip
    # candidates: 7,2 = -1.1 (stop, rank 0), 7,5 = -2.0, 8,2 = -2.1 (stop, rank 2: not kept), ...
    assert search.done and live == []
    assert [(h.token_ids, round(h.score, 4)) for h in search.hypotheses] == [([2], -0.5), ([7, 2], -0.55)]


SMOL_QUESTIONS = ["What is 2+2? Reply with a number only.", "Say hello.", "What color is the sky? One word.",
                  "Name a fruit.", "Is fire hot? Answer yes or no."]  # fmt: skip


@pytest.fixture(scope="module")
def smol_expected(smollm2_dir: Path) -> tuple[list[list[int]], dict[int, list[list[list[int]]]]]:
    """Chat prompts to SmolLM2 and transformers' W = 2, 4, 8 beams for them (fp32, 24 new tokens;
    beams end on EOS at different lengths, and some at the limit)."""
    from pagedserve.worker.loader import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    chats = [[{"role": "user", "content": q}] for q in SMOL_QUESTIONS]
    prompts = [list(tok.apply_chat_template(c, add_generation_prompt=True, return_dict=True)["input_ids"])
               for c in chats]  # fmt: skip
    eos = [tok.eos_token_id]
    return prompts, {w: [hf_beams(smollm2_dir, p, w, w, 24, eos) for p in prompts] for w in (2, 4, 8)}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_smollm2_beams_equal_transformers_under_preemption(smol_expected, mode):
    """The real default model in fp32: five chat prompts at once, W = 2, 4, 8, prefix caching on,
    a pool of 40 blocks (five W = 8 groups need ~135): groups are preempted whole and every beam
    still equals transformers' beam search, EOS endings included."""
    prompts, expected = smol_expected
    llm = LLM(None, dtype="float32", max_model_len=256, block_size=16, num_gpu_blocks_override=40,
              preemption_mode=mode)  # fmt: skip
    counts = count_plans(llm)
    for width in (2, 4, 8):
        params = SamplingParams(use_beam_search=True, n=width, temperature=0, max_tokens=24)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [[o.token_ids for o in out.outputs] for out in outs] == expected[width], width
    finish = Counter(o.finish_reason for out in outs for o in out.outputs)
    assert finish["stop"] > 0 and finish["length"] > 0
    assert llm.stats().num_preemptions > 0
    if mode == "swap":
        assert counts["swap_out"] > 0 and counts["swap_in"] > 0
    assert_pool_empty(llm)


def test_a_group_stalled_half_admitted_is_recomputed_whole(tiny_engine_model, prompts):
    """A beam that reported waits for its siblings; when they cannot come back (the pool is full)
    and nothing else runs, nothing would ever change. The scheduler then recomputes the group
    whole, and once there is room it finishes with transformers' beams."""
    llm = LLM(str(tiny_engine_model), dtype="float32", max_model_len=128, block_size=4,
              num_gpu_blocks_override=200, watermark=0.0)  # fmt: skip
    engine, scheduler, bm = llm.engine, llm.engine.scheduler, llm.engine.block_manager
    prompt = prompts[1]
    engine.add_request("g", {"prompt_token_ids": prompt}, beam_params(4, 2, 1.0, False))
    for _ in range(4):
        engine.step()
    group = engine._groups["g"].beam_group
    scheduler._preempt(group.beams[0], StepPlan([]), {}, recompute=True)
    scheduler.config.max_num_seqs = 1  # only the first beam comes back, and reports
    engine.step()
    scheduler.config.max_num_seqs = 128
    statuses = [b.status.value for b in group.beams]
    assert statuses == ["running", "waiting", "waiting", "waiting"]
    assert group.beams[0].beam_candidates is not None
    hog = list(range(4 * bm.num_free_blocks))
    assert bm.allocate("hog", hog, len(hog)) is not None  # every free block taken
    engine.step()
    assert [b.status.value for b in group.beams] == ["waiting"] * 4  # recomputed whole
    assert not any(b.request_id in bm for b in group.beams)
    bm.free("hog")
    out = run_to_completion(engine, ["g"])["g"]
    assert [o.token_ids for o in out.outputs] == hf_beams(tiny_engine_model, prompt, 4, 4, MAX_NEW, [2])
    assert_pool_empty(llm)
