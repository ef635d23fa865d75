import pytest

from pagedserve.config import ConfigError, EngineConfig, ServeConfig


def test_flags_map_onto_the_config_dataclasses():
    cfg = EngineConfig.from_flags(model="/m", block_size=32, max_num_seqs=8, preemption_mode="swap",
                                  kv_cache_memory=1 << 20, enable_prefix_caching=False)  # fmt: skip
    assert cfg.model.model == "/m" and cfg.cache.block_size == 32 and cfg.scheduler.max_num_seqs == 8
    assert cfg.scheduler.preemption_mode == "swap" and not cfg.cache.enable_prefix_caching
    assert EngineConfig.from_flags(**cfg.to_flags()) == cfg


@pytest.mark.parametrize(
    "flags, match",
    [
        ({"block_size": 24}, "block-size"),
        ({"gpu_memory_utilization": 1.5}, "gpu-memory-utilization"),
        ({"preemption_mode": "drop"}, "preemption-mode"),
        ({"max_num_seqs": 0}, "max-num-seqs"),
        ({"tensor_parallel_size": 0}, "tensor-parallel-size must be >= 1"),
        ({"placement_group_strategy": "ANYWHERE"}, "placement-group-strategy"),
        ({"distributed_executor_backend": "mp", "tensor_parallel_size": 2}, "tensor parallelism uses ray"),
        ({"step_timeout_s": 0}, "step-timeout-s"),
        ({"dtype": "int8"}, "dtype"),
        ({"no_such_flag": 1}, "unknown engine option"),
        ({"max_model_len": 4096, "max_num_batched_tokens": 2048, "enable_chunked_prefill": False},
         "max-num-batched-tokens"),
    ],
)
def test_bad_values_name_the_flag(flags, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig.from_flags(**flags)


def test_serve_config_defaults_to_loopback():
    assert ServeConfig().host == "127.0.0.1"
    with pytest.raises(ConfigError, match="routing"):
        ServeConfig(routing="random")
