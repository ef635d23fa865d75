"""Building the Serve application from flags (no Ray needed): option mapping and deployment options."""

from __future__ import annotations

import os

import pytest
from ray.serve import Application

from pagedserve.config import ConfigError, EngineConfig, ServeConfig
from pagedserve.router.app import (
    OMP_SPIN_COUNT,
    SERVE_CONTROL_LOOP_INTERVAL_S,
    app_builder,
    build_app,
    compact_kv_events,
    cpu_threads_per_replica,
    engine_env,
    private_ray_env,
    serve_config_from_flags,
    served_model_name,
)


def test_flags_map_onto_the_config_dataclasses() -> None:
    config = serve_config_from_flags(
        {
            "model": "/models/m",
            "num_replicas": 2,
            "routing": "round_robin",
            "max_waiting_requests": 8,
            "max_model_len": 1024,
            "block_size": 32,
            "enable_prefix_caching": False,
            "preemption_mode": "swap",
            "api_key": "k",
        }
    )
    assert (config.num_replicas, config.routing, config.max_waiting_requests, config.api_key) == (
        2,
        "round_robin",
        8,
        "k",
    )
    engine = config.engine
    assert (engine.model.model, engine.model.max_model_len, engine.cache.block_size) == (
        "/models/m",
        1024,
        32,
    )
    assert engine.cache.enable_prefix_caching is False and engine.scheduler.preemption_mode == "swap"


def test_string_values_from_serve_run_are_converted() -> None:
    # `serve run pagedserve.router.app:app_builder num-replicas=2 ...` passes every value as a string
    config = serve_config_from_flags(
        {
            "num-replicas": "2",
            "enable_prefix_caching": "false",
            "max_model_len": "none",
            "gpu_memory_utilization": "0.5",
            "kv_cache_memory": "1048576",
        }
    )
    assert config.num_replicas == 2 and config.engine.cache.enable_prefix_caching is False
    assert config.engine.model.max_model_len is None and config.engine.cache.gpu_memory_utilization == 0.5
    assert config.engine.cache.kv_cache_memory == 1 << 20


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"num_replicas": "two"}, "num_replicas"),
        ({"enable_prefix_caching": "maybe"}, "enable_prefix_caching"),
        ({"replicas": 2}, "unknown option"),
        ({"routing": "random"}, "--routing"),
        ({"tensor_parallel_size": 0}, "--tensor-parallel-size"),
    ],
)
def test_bad_flags_raise_config_errors(flags: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        serve_config_from_flags(flags)


@pytest.mark.parametrize("routing", ["prefix", "pow2", "round_robin"])
def test_build_app_for_each_routing_policy(routing: str) -> None:
    assert isinstance(build_app(ServeConfig(routing=routing, num_replicas=2)), Application)


def test_app_builder_takes_flat_args() -> None:
    assert isinstance(
        app_builder({"num_replicas": "1", "routing": "prefix", "max_model_len": "512"}), Application
    )


def test_cpu_threads_leave_the_reserved_cores_to_the_serving_stack(monkeypatch) -> None:
    assert cpu_threads_per_replica(1, cpus=2) == 1  # one core for the proxy, ingress and Ray
    assert cpu_threads_per_replica(1, cpus=16) == 15
    assert cpu_threads_per_replica(2, cpus=16) == 7
    assert cpu_threads_per_replica(4, cpus=2) == 1  # never none
    assert cpu_threads_per_replica(1, cpus=2, reserved=0) == 2  # prefill steps' count
    monkeypatch.setenv("PAGEDSERVE_CPU_RESERVED_CORES", "0")
    assert cpu_threads_per_replica(1, cpus=2) == 2


def test_engine_env_carries_the_cpu_switches_from_the_serving_shell(monkeypatch) -> None:
    monkeypatch.delenv("PAGEDSERVE_CACHE_DIR", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    for key in [k for k in os.environ if k.startswith("PAGEDSERVE_CPU_")]:
        monkeypatch.delenv(key)
    cfg = ServeConfig()
    env = engine_env(cfg, 1)
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and env["OMP_NUM_THREADS"] == "1"
    # a bounded spin (which GNU OpenMP takes over PASSIVE) so a step's parallel regions run back to back
    assert env["GOMP_SPINCOUNT"] == OMP_SPIN_COUNT and 0 < int(OMP_SPIN_COUNT) <= 100_000
    assert env["PAGEDSERVE_CPU_PREFILL_THREADS"] == str(cpu_threads_per_replica(1, reserved=0))
    monkeypatch.setenv("PAGEDSERVE_CPU_SHARE_BLOCKS", "0")
    monkeypatch.setenv("PAGEDSERVE_CPU_PREFILL_THREADS", "3")
    monkeypatch.setenv("PAGEDSERVE_OTHER", "x")
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    env = engine_env(cfg, 1)
    assert env["GOMP_SPINCOUNT"] == "0"
    assert env["PAGEDSERVE_CPU_SHARE_BLOCKS"] == "0" and env["PAGEDSERVE_CPU_PREFILL_THREADS"] == "3"
    assert "PAGEDSERVE_OTHER" not in env


def test_served_model_name() -> None:
    assert served_model_name(EngineConfig()) == "SmolLM2-135M-Instruct"
    assert served_model_name(EngineConfig.from_flags(model="/m/llama")) == "/m/llama"
    assert served_model_name(EngineConfig.from_flags(model="/m/llama", served_model_name="llama")) == "llama"


def test_deploy_files_are_valid() -> None:
    """deploy/serve_config.yaml passes Serve's schema and builds; deploy/cluster.yaml passes `ray up`'s."""
    from pathlib import Path

    import yaml
    from ray.autoscaler._private.util import prepare_config, validate_config
    from ray.serve.schema import ServeDeploySchema

    root = Path(__file__).resolve().parents[2] / "deploy"
    serve_config = ServeDeploySchema.model_validate(yaml.safe_load((root / "serve_config.yaml").read_text()))
    (application,) = serve_config.applications
    assert application.import_path == "pagedserve.router.app:app_builder"
    assert isinstance(app_builder(application.args), Application)
    assert serve_config.http_options.host == "127.0.0.1"
    validate_config(prepare_config(yaml.safe_load((root / "cluster.yaml").read_text())))


def test_compacted_kv_events_have_the_same_effect() -> None:
    events = [
        ("stored", [1, 2, 3]),
        ("removed", [2]),
        ("stored", [4, 2]),
        ("removed", [1, 5]),
        ("stored", [5]),
    ]

    def apply(held: set[int], evs: list) -> set[int]:
        for kind, hashes in evs:
            held = held | set(hashes) if kind == "stored" else held - set(hashes)
        return held

    compacted = compact_kv_events(events)
    assert len(compacted) == 2
    for start in (set(), {1, 2, 3, 4, 5, 6}, {6, 1}):
        assert apply(start, compacted) == apply(start, events)


class _FakeCall:
    """What ``handle.options(stream=True).generate.remote()`` returns: deltas, then maybe an error."""

    def __init__(self, deltas: list[dict], error: BaseException | None) -> None:
        self.deltas, self.error, self.cancelled = deltas, error, False

    def __aiter__(self):
        return self._run()

    async def _run(self):
        for d in self.deltas:
            yield d
        if self.error is not None:
            raise self.error

    def cancel(self) -> None:
        self.cancelled = True


class _FakeStreaming:
    def __init__(self, calls: list[_FakeCall]) -> None:
        self.calls, self.sent = calls, 0
        self.generate = self

    def remote(self, request: dict) -> _FakeCall:
        self.sent += 1
        return self.calls.pop(0)


def _ingress(calls: list[_FakeCall]):
    from pagedserve.router.app import OpenAIIngress

    ingress = object.__new__(OpenAIIngress.func_or_class)  # no Serve: only generate() is under test
    ingress._streaming = _FakeStreaming(calls)
    return ingress


def _collect(ingress) -> list[dict]:
    import asyncio

    async def run() -> list[dict]:
        return [d async for d in ingress.generate({"request_id": "r"})]

    return asyncio.run(run())


def test_a_lost_replica_is_retried_until_streaming_then_fails_with_engine_lost(monkeypatch) -> None:
    """The ingress's handling of a replica whose process died (ActorDiedError from the handle): a
    request that has streamed nothing is sent again, one that has streamed ends with a 503
    ``engine_lost``; at most RETRIES_ON_REPLICA_LOSS resends."""
    from ray.exceptions import ActorDiedError

    from pagedserve.router import app
    from pagedserve.router.protocol import OpenAIError

    monkeypatch.setattr(app, "REPLICA_LOSS_BACKOFF_S", 0.0)
    delta = {"outputs": [{"token_ids": [5]}], "finished": False}
    last = {"outputs": [{"token_ids": [6]}], "finished": True}
    # lost before any delta, twice: sent again, then served whole by the third replica
    ingress = _ingress([_FakeCall([], ActorDiedError()), _FakeCall([], ActorDiedError()),
                        _FakeCall([delta, last], None)])  # fmt: skip
    assert _collect(ingress) == [delta, last] and ingress._streaming.sent == 3
    # lost after streaming a delta: no resend (the client has part of the output), a clear error
    ingress = _ingress([_FakeCall([delta], ActorDiedError())])
    with pytest.raises(OpenAIError) as err:
        _collect(ingress)
    assert (err.value.status, err.value.code) == (503, "engine_lost") and ingress._streaming.sent == 1
    # lost every time: the resends are bounded
    ingress = _ingress([_FakeCall([], ActorDiedError()) for _ in range(app.RETRIES_ON_REPLICA_LOSS + 1)])
    with pytest.raises(OpenAIError) as err:
        _collect(ingress)
    assert err.value.code == "engine_lost" and ingress._streaming.sent == app.RETRIES_ON_REPLICA_LOSS + 1


def test_private_ray_env_slows_serves_controller_loop_unless_the_shell_says(monkeypatch) -> None:
    monkeypatch.delenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", raising=False)
    env = private_ray_env(ServeConfig(proxy_location="Direct", port=8123))
    assert env["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == SERVE_CONTROL_LOOP_INTERVAL_S
    assert float(SERVE_CONTROL_LOOP_INTERVAL_S) > 0.1  # Serve's default
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"  # and Direct's own
    monkeypatch.setenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.2")
    env = private_ray_env(ServeConfig(proxy_location="EveryNode"))
    assert env == {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.2"}


class _QuietEngine:
    """What EngineDeployment's publisher reads of its engine: no blocks, no events."""

    async def block_states(self) -> list:
        return []

    def take_kv_events(self) -> list:
        return []


def test_a_replica_publishes_often_while_busy_and_seldom_idle(monkeypatch) -> None:
    """The publisher's cadence: one publish at start, then none while idle until the idle period
    passes; at once when a request arrives, every PUBLISH_PERIOD_S while requests are in flight,
    one more round after the last one ends (the engine's figures lag a step), then the idle period."""
    import asyncio
    import time

    from pagedserve.router import app as app_module
    from pagedserve.router import state

    monkeypatch.setattr(app_module, "PUBLISH_PERIOD_S", 0.02)
    monkeypatch.setattr(app_module, "PUBLISH_IDLE_S", 5.0)
    published: list[tuple[float, int]] = []

    async def scenario() -> None:
        class Replica(app_module.EngineDeployment.func_or_class):
            def __del__(self) -> None:  # no state actor to leave
                pass

        replica = Replica.__new__(Replica)  # the publisher's attributes only, set below
        replica.engine, replica._inflight, replica._commands, replica._results = _QuietEngine(), 0, set(), {}
        replica._unpublished, replica._state_epoch, replica._draining = [], None, False
        replica._block_map, replica._wake = None, asyncio.Event()
        replica._stats_dict = lambda: {"num_running": replica._inflight}

        async def publish(replica_id, events, stats, results):
            published.append((time.monotonic(), stats["num_running"]))
            return {"epoch": "e", "draining": False, "commands": []}

        monkeypatch.setattr(state, "publish_replica_state", publish)
        replica.replica_id = "r"
        task = asyncio.get_running_loop().create_task(replica._publish_forever())
        await asyncio.sleep(0.3)
        assert len(published) == 1  # the first; idle, the next waits PUBLISH_IDLE_S
        replica._inflight = 1  # a request arrives (generate sets the wake event)
        replica._wake.set()
        arrived = time.monotonic()
        await asyncio.sleep(0.3)
        busy = [t for t, running in published if running == 1]
        assert busy and busy[0] - arrived < 0.1  # at once, not at the idle beat
        assert len(busy) >= 5  # every 0.02 s while busy (a loaded 2-core machine: a margin)
        replica._inflight = 0
        await asyncio.sleep(0.3)
        after = [t for t, running in published if t > busy[-1]]
        assert len(after) == 2 and after[-1] - busy[-1] < 0.1  # the last request's end goes out
        task.cancel()

    asyncio.run(scenario())
