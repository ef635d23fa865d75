"""Engine and server configuration: a few dataclasses, validated where they are made.

Field names are vLLM's flags (``--block-size`` is ``CacheConfig.block_size``); ``from_flags``
is the one place that turns CLI flags or a YAML/dict into them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

PREEMPTION_MODES = ("recompute", "swap")
PROXY_LOCATIONS = ("EveryNode", "HeadOnly", "Disabled", "Direct")
ROUTING_POLICIES = ("prefix", "pow2", "round_robin")
CONTROL_PLANE_POLICIES = ("idle", "normal")  # cluster/control_plane.py
DTYPES = ("auto", "float32", "float16", "bfloat16")


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the flag."""


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


@dataclass(slots=True)
class ModelConfig:
    model: str | None = None  # HF folder, GGUF file, or None for the default SmolLM2-135M-Instruct
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    seed: int = 0
    served_model_name: str | None = None

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES, f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        _require(self.max_model_len is None or self.max_model_len > 0, "--max-model-len must be positive")


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None  # bytes of KV pool on CPU (and on GPU if set); None: a default
    num_gpu_blocks_override: int | None = None
    swap_space: float = 1.0  # GiB of host memory per worker for swapped-out blocks
    enable_prefix_caching: bool = True
    # keep every layer's blocks for sliding-window layers too (one block table per request)
    disable_hybrid_kv_cache_manager: bool = False

    def __post_init__(self) -> None:
        _require(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "--block-size must be a power of 2 <= 128")
        _require(0 < self.gpu_memory_utilization <= 1, "--gpu-memory-utilization must be in (0, 1]")
        _require(
            self.kv_cache_memory is None or self.kv_cache_memory > 0, "--kv-cache-memory must be positive"
        )
        _require(
            self.num_gpu_blocks_override is None or self.num_gpu_blocks_override > 0,
            "--num-gpu-blocks-override must be positive",
        )
        _require(self.swap_space >= 0, "--swap-space must be >= 0")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    scheduling_policy: str = "fcfs"  # or "priority": lower value first, then arrival
    watermark: float = 0.01  # fraction of blocks kept free at admission, against preemption thrash
    max_beam_width: int = 16  # widest beam search a request may ask for (also capped by max_num_seqs)

    def __post_init__(self) -> None:
        _require(self.max_num_seqs > 0, "--max-num-seqs must be positive")
        _require(self.max_num_batched_tokens > 0, "--max-num-batched-tokens must be positive")
        _require(
            self.preemption_mode in PREEMPTION_MODES, f"--preemption-mode must be one of {PREEMPTION_MODES}"
        )
        _require(
            self.scheduling_policy in ("fcfs", "priority"), "--scheduling-policy must be fcfs or priority"
        )
        _require(0 <= self.watermark < 1, "--watermark must be in [0, 1)")
        _require(self.max_beam_width >= 1, "--max-beam-width must be >= 1")

    @property
    def finish_slack(self) -> int:
        """Tokens a step may take beyond ``max_num_batched_tokens`` to finish a prompt's prefill
        rather than leave it a sliver for the next step: 1/32 of the budget (64 of 2048). A burst of
        equal prompts behind a few decode rows otherwise has its last prompt cut a few tokens short,
        and that request gets its first token a whole step (~0.5 s on CPU) later."""
        return self.max_num_batched_tokens // 32

    @property
    def max_step_tokens(self) -> int:
        """The most tokens one step runs: the budget plus the slack."""
        return self.max_num_batched_tokens + self.finish_slack


PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
PLAN_TRANSPORTS = ("socket", "compiled_graph", "actor_call")


@dataclass(slots=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None: in-process for tp=1, "ray" above
    placement_group_strategy: str = "STRICT_PACK"  # of a replica's ranks; PACK lets a group span nodes
    plan_transport: str = "socket"  # how plans reach the ranks: socket, compiled_graph or actor_call
    step_timeout_s: float = 300.0  # a tensor-parallel step not done by then fails and rebuilds the group

    def __post_init__(self) -> None:
        _require(self.tensor_parallel_size >= 1, "--tensor-parallel-size must be >= 1")
        _require(
            self.distributed_executor_backend in (None, "ray", "mp"),
            "--distributed-executor-backend must be ray (or mp for size 1)",
        )
        _require(
            self.distributed_executor_backend != "mp" or self.tensor_parallel_size == 1,
            "--distributed-executor-backend mp runs one rank in process; tensor parallelism uses ray",
        )
        _require(
            self.placement_group_strategy in PLACEMENT_STRATEGIES,
            f"--placement-group-strategy must be one of {PLACEMENT_STRATEGIES}",
        )
        _require(self.step_timeout_s > 0, "--step-timeout-s must be positive")
        _require(self.plan_transport in PLAN_TRANSPORTS, f"--plan-transport must be one of {PLAN_TRANSPORTS}")

    @property
    def uses_ray(self) -> bool:
        return self.tensor_parallel_size > 1 or self.distributed_executor_backend == "ray"


@dataclass(slots=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.model.max_model_len is not None and not self.scheduler.enable_chunked_prefill:
            _require(
                self.scheduler.max_num_batched_tokens >= self.model.max_model_len,
                "--max-num-batched-tokens must be >= --max-model-len without chunked prefill",
            )

    @classmethod
    def from_flags(cls, **flags: Any) -> EngineConfig:
        """Build from flat vLLM-named options (CLI flags, YAML, LLM(...) kwargs); unknown names fail."""
        parts: dict[str, dict[str, Any]] = {"model": {}, "cache": {}, "scheduler": {}, "parallel": {}}
        owners = {
            "model": ModelConfig,
            "cache": CacheConfig,
            "scheduler": SchedulerConfig,
            "parallel": ParallelConfig,
        }
        names = {f.name: part for part, klass in owners.items() for f in fields(klass)}
        for key, value in flags.items():
            key = key.replace("-", "_")
            if key not in names:
                raise ConfigError(f"unknown engine option {key!r}")
            if value is not None or key in ("model", "max_model_len"):
                parts[names[key]][key] = value
        return cls(**{part: owners[part](**kw) for part, kw in parts.items()})

    def to_flags(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for part in (self.model, self.cache, self.scheduler, self.parallel):
            out.update(asdict(part))
        return out


@dataclass(slots=True)
class ServeConfig:
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000
    num_replicas: int = 1
    routing: str = "prefix"
    api_key: str | None = None
    admin_token: str | None = None  # the dashboard's and /admin/api's token (None: one is generated)
    # Ray custom resources each engine replica reserves, e.g. {"pagedserve_engine": 1}: replicas
    # then go only to nodes started with that resource (one per node with a count of 1)
    replica_resources: dict[str, float] | None = None
    # where Serve runs HTTP proxies: "EveryNode" (Serve's default), "HeadOnly" (one box with
    # several raylets: their proxies would share the port), "Disabled", or "Direct": the ingress
    # replica serves HTTP itself (no proxy hop), on a private Ray only (app.direct_ingress_env;
    # `pagedserve serve`'s default without --address)
    proxy_location: str = "EveryNode"
    address: str | None = None  # RAY_ADDRESS to join; None starts a private local Ray
    # the private Ray's control plane (Ray's and Serve's daemons, not the replicas) at Linux's
    # SCHED_IDLE ("idle"), or left as started ("normal"); see cluster/control_plane.py
    control_plane_policy: str = "idle"
    max_waiting_requests: int = 256  # per replica; past it, 503 with Retry-After
    # a one-rank engine's scheduler and model run in a child process of the replica (vLLM's
    # EngineCore), with a GIL of their own; False keeps them on a thread of the replica
    engine_process: bool = True
    # Request limits at the HTTP front (400 past them; the defaults are the engine's own caps)
    max_body_bytes: int = 8 << 20  # a larger body gets 413
    body_timeout_s: float = 30.0  # a body trickled slower than this gets 408 (slow-loris)
    max_n: int = 128  # n, best_of and beam width
    max_logprobs: int = 20  # logprobs, top_logprobs and prompt_logprobs
    max_output_tokens: int | None = None  # max_tokens of one request (None: the context's room)
    max_prompt_tokens: int | None = None  # prompt tokens of one request (None: max_model_len - 1)
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        _require(0 < self.port < 65536, "--port must be in 1..65535")
        _require(self.num_replicas >= 1, "--num-replicas must be >= 1")
        _require(self.routing in ROUTING_POLICIES, f"--routing must be one of {ROUTING_POLICIES}")
        _require(self.proxy_location in PROXY_LOCATIONS, f"--proxy-location must be one of {PROXY_LOCATIONS}")
        _require(self.control_plane_policy in CONTROL_PLANE_POLICIES,
                 f"--control-plane-policy must be one of {CONTROL_PLANE_POLICIES}")  # fmt: skip
        _require(self.proxy_location != "Direct" or self.address is None,
                 "--proxy-location Direct needs the private Ray of `pagedserve serve` (no --address): Serve "
                 "reads its direct-ingress settings as each Ray process starts")  # fmt: skip
        _require(self.max_waiting_requests >= 1, "--max-waiting-requests must be >= 1")
        _require(self.max_body_bytes >= 1024, "--max-body-bytes must be >= 1024")
        _require(self.body_timeout_s > 0, "--body-timeout-s must be positive")
        _require(1 <= self.max_n <= 128, "--max-n must be in 1..128")
        _require(0 <= self.max_logprobs <= 20, "--max-logprobs must be in 0..20")
        for name, amount in (self.replica_resources or {}).items():
            _require(isinstance(name, str) and name and float(amount) > 0,
                     f"--replica-resources: {name!r} needs a positive amount")  # fmt: skip
        for name in ("max_output_tokens", "max_prompt_tokens"):
            value = getattr(self, name)
            _require(value is None or value >= 1, f"--{name.replace('_', '-')} must be >= 1")
