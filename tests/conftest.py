"""Process-wide test settings (set before torch or triton is imported) and shared fixtures."""

import os
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
