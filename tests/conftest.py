"""Process-wide test settings; they must be set before torch or triton is imported."""

import os

# Triton kernels run on CPU only through the interpreter; it must be on before @triton.jit runs.
os.environ.setdefault("TRITON_INTERPRET", "1")
# OpenMP spin-waiting turns a ~80 ms CPU step into seconds when another process holds a core.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
