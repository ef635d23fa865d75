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
