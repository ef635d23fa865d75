"""The worker's thread count for CPU steps of few tokens: calibrated at start (one thread or all,
whichever decoded faster), then applied to every such step; larger steps take all threads, and so
does the decode attention of a step over much KV."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve.kernels import cpu as cpu_kernels
from pagedserve.plan import ScheduledSeq, StepPlan
from pagedserve.worker import worker as worker_module
from pagedserve.worker.worker import (
    DECODE_ATTENTION_KV_TOKENS,
    LARGE_STEP_TOKENS,
    SMALL_STEP_TOKENS,
    Worker,
)


@pytest.fixture
def two_threads(torch_threads) -> None:
    torch_threads(2)


def _fake_clock(monkeypatch, slow_threads: int) -> None:
    """perf_counter advancing 2 units around each forward on `slow_threads`, 1 on any other."""
    now = [0.0]

    def perf_counter() -> float:
        now[0] += 1.0 if torch.get_num_threads() == slow_threads else 0.5
        return now[0]

    monkeypatch.setattr(worker_module.time, "perf_counter", perf_counter)


@pytest.mark.parametrize("slow", [1, 2])
def test_calibration_keeps_the_faster_count(tiny_engine_model: Path, two_threads, monkeypatch, slow) -> None:
    w = Worker(str(tiny_engine_model), dtype="float32")
    assert w.max_threads == 2
    w.init_kv_pool(num_blocks=32, block_size=8)  # calibrates with the real clock: 1 or 2
    assert w.small_step_threads in (1, 2)
    _fake_clock(monkeypatch, slow)
    assert w.calibrate_threads() == 3 - slow
    assert torch.get_num_threads() == 2, "calibration leaves the full count set"


def test_small_steps_run_on_the_calibrated_count(tiny_engine_model: Path, two_threads) -> None:
    w = Worker(str(tiny_engine_model), dtype="float32")
    w.init_kv_pool(num_blocks=32, block_size=8)
    params = {"temperature": 0.0, "max_tokens": 4}
    prompt = list(range(5, 5 + SMALL_STEP_TOKENS + 4))
    outputs = {}
    for small in (1, 2):
        w.small_step_threads = small
        w.states.clear()
        w.execute(StepPlan([ScheduledSeq(f"r{small}", prompt, 0, 0, [[0, 1]], True,
                                         new={"params": params, "prompt_token_ids": prompt})]))  # fmt: skip
        assert torch.get_num_threads() == 2, "a prefill of more than SMALL_STEP_TOKENS takes all threads"
        out = w.execute(StepPlan([ScheduledSeq(f"r{small}", [9], len(prompt), 2, [[]], True)]))
        assert torch.get_num_threads() == small
        outputs[small] = out.sampled[0].token_id
    assert outputs[1] == outputs[2], "the thread count changes speed, not the greedy token"


def test_prefill_steps_take_the_reserved_cores_too(tiny_engine_model: Path, monkeypatch) -> None:
    """Served, the replica's torch runs on the cores less the reserved one, and prefill steps of
    LARGE_STEP_TOKENS or more on PAGEDSERVE_CPU_PREFILL_THREADS (its share of all cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("PAGEDSERVE_CPU_PREFILL_THREADS", "2")
    monkeypatch.setattr(worker_module, "PREFILL_CALIBRATE", False)  # two as given (calibration: below)
    try:
        w = Worker(str(tiny_engine_model), dtype="float32")
        assert (w.max_threads, w.prefill_threads) == (1, 2)
        w.init_kv_pool(num_blocks=64, block_size=8)
        params = {"temperature": 0.0, "max_tokens": 4}
        seen = {}
        for n in (SMALL_STEP_TOKENS + 1, LARGE_STEP_TOKENS):
            prompt = list(range(5, 5 + n))
            new, blocks = {"params": params, "prompt_token_ids": prompt}, list(range(-(-n // 8)))
            w.states.clear()
            w.execute(StepPlan([ScheduledSeq(f"p{n}", prompt, 0, 0, [blocks], True, new=new)]))
            seen[n] = torch.get_num_threads()
        assert seen == {SMALL_STEP_TOKENS + 1: 1, LARGE_STEP_TOKENS: 2}
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def prefill_worker(tiny_engine_model: Path, monkeypatch):
    """A worker of one torch thread whose prefill steps may take two (as served), its pool made
    (which calibrates with the real clock: either choice)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("PAGEDSERVE_CPU_PREFILL_THREADS", "2")
    monkeypatch.setattr(worker_module, "PREFILL_CALIBRATE_PAUSE_S", 0.0)
    try:
        w = Worker(str(tiny_engine_model), dtype="float32")
        w.init_kv_pool(num_blocks=64, block_size=8)
        assert w.prefill_threads in (1, 2)
        yield w
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("wide_time", "chosen"), [(0.5, 2), (0.9, 2), (0.97, 1), (1.2, 1)])
def test_prefill_threads_are_calibrated(prefill_worker: Worker, monkeypatch, wide_time, chosen) -> None:
    """Prefill steps keep PAGEDSERVE_CPU_PREFILL_THREADS only where a prefill on them took at
    most PREFILL_GAIN (0.95) of one thread's time; else they run on one. The calibration runs
    when the pool is made and leaves the count as set."""
    w = prefill_worker
    now = [0.0]

    def perf_counter() -> float:
        now[0] += wide_time if torch.get_num_threads() == 2 else 1.0
        return now[0]

    monkeypatch.setattr(worker_module.time, "perf_counter", perf_counter)
    w.prefill_threads = 2
    assert w.calibrate_prefill_threads() == chosen == w.prefill_threads
    assert torch.get_num_threads() == 1, "calibration leaves the count as it found it"
    monkeypatch.undo()
    prompt = list(range(5, 5 + LARGE_STEP_TOKENS))
    new = {"params": {"temperature": 0.0, "max_tokens": 2}, "prompt_token_ids": prompt}
    w.states.clear()
    w.execute(StepPlan([ScheduledSeq("p", prompt, 0, 0, [list(range(16))], True, new=new)]))
    assert torch.get_num_threads() == chosen, "a prefill step runs on the calibrated count"


def _prefill_then_decode(w: Worker, batch: int, length: int) -> list[int]:
    """Prefill `batch` prompts of `length` tokens (17 blocks of 8 each), then one decode step of
    all of them; its greedy tokens."""
    params = {"temperature": 0.0, "max_tokens": 4}
    w.states.clear()
    seqs = []
    for b in range(batch):
        prompt = [5 + (7 * b + i) % 300 for i in range(length)]
        new = {"params": params, "prompt_token_ids": prompt}
        seqs.append(ScheduledSeq(f"s{b}", prompt, 0, 0, [list(range(b * 17, b * 17 + 17))], True, new=new))
    out = w.execute(StepPlan(seqs))
    step = [ScheduledSeq(f"s{b}", [t.token_id], length, 17, [[]], True) for b, t in enumerate(out.sampled)]
    return [t.token_id for t in w.execute(StepPlan(step)).sampled]


def test_decode_attention_over_much_kv_runs_on_prefill_threads(tiny_engine_model: Path, monkeypatch) -> None:
    """Served (one torch thread, two for prefill) with PAGEDSERVE_CPU_DECODE_ATTENTION_KV_TOKENS
    set, a decode step whose sequences hold that many KV tokens or more runs its attention kernel
    on the prefill threads, the rest of the step on one; a step over less KV, or with the switch
    unset (0), keeps one for all. The greedy tokens do not change."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("PAGEDSERVE_CPU_PREFILL_THREADS", "2")
    monkeypatch.setattr(worker_module, "PREFILL_CALIBRATE", False)
    asked = []
    real = cpu_kernels.set_decode_threads
    monkeypatch.setattr(cpu_kernels, "set_decode_threads", lambda n: asked.append(n) or real(n))
    try:
        w = Worker(str(tiny_engine_model), dtype="float32")
        w.init_kv_pool(num_blocks=160, block_size=8)
        assert DECODE_ATTENTION_KV_TOKENS == 0, "off by default"
        monkeypatch.setattr(worker_module, "DECODE_ATTENTION_KV_TOKENS", 1024)  # 8 x 41 < 1024 <= 8 x 131
        _prefill_then_decode(w, 8, 40)
        assert asked[-1] == 0 and torch.get_num_threads() == 1
        wide = _prefill_then_decode(w, 8, 130)
        assert asked[-2:] == [0, 2], "the prefill runs on 2 threads all through; the decode, its attention"
        assert torch.get_num_threads() == 1
        monkeypatch.setattr(worker_module, "DECODE_ATTENTION_KV_TOKENS", 0)
        assert _prefill_then_decode(w, 8, 130) == wide, "the same tokens with the attention on one thread"
        assert asked[-1] == 0
    finally:
        torch.set_num_threads(before)
        cpu_kernels.set_decode_threads(0)


def test_prefill_calibration_takes_each_count_at_its_fastest(prefill_worker: Worker, monkeypatch) -> None:
    """Runs disturbed by other processes (as while the replica starts) take longer; the choice
    compares the fastest run of each count, so two threads win here though their median lost."""
    w = prefill_worker
    wide = iter([0.5, 3.0, 0.5, 3.0, 3.0, 3.0])  # warm-up, then 5 rounds: median 3.0, best 0.5
    now = [0.0]
    ticks = []

    def perf_counter() -> float:
        if not ticks:  # a run's start: advance by the run's duration at its end
            ticks.append(next(wide) if torch.get_num_threads() == 2 else 1.0)
            return now[0]
        now[0] += ticks.pop()
        return now[0]

    monkeypatch.setattr(worker_module.time, "perf_counter", perf_counter)
    w.prefill_threads = 2
    assert w.calibrate_prefill_threads() == 2 == w.prefill_threads


@pytest.mark.parametrize(("one", "attempts", "chosen"), [(1.0, 2, 2), (0.01, 1, 1)])
def test_prefill_calibration_tries_again_while_two_threads_lose(prefill_worker: Worker, monkeypatch, one,
                                                                attempts, chosen) -> None:  # fmt: skip
    """The other core busy for a whole round (as while Serve starts) slows every run on two
    threads: the rounds are tried again, seconds apart, and one clear win keeps two threads.
    Where a prefill on one thread is short (a tiny model) one round decides."""
    w = prefill_worker
    wide = iter([3.0] * 6 + [0.5] * 6)  # first round's runs disturbed, then quiet
    now, ticks, pauses = [0.0], [], []

    def perf_counter() -> float:
        if not ticks:
            ticks.append(next(wide) * one if torch.get_num_threads() == 2 else one)
            return now[0]
        now[0] += ticks.pop()
        return now[0]

    monkeypatch.setattr(worker_module.time, "perf_counter", perf_counter)
    monkeypatch.setattr(worker_module.time, "sleep", pauses.append)
    monkeypatch.setattr(worker_module, "PREFILL_CALIBRATE_PAUSE_S", 2.0)
    w.prefill_threads = 2
    assert w.calibrate_prefill_threads() == chosen == w.prefill_threads
    assert pauses == [2.0] * (attempts - 1)
