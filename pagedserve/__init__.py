"""pagedserve: LLM serving on Ray built around PagedAttention.

``from pagedserve import LLM, SamplingParams`` is the offline API (vLLM's shape).
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "EngineConfig"]


def __getattr__(name: str) -> Any:
    # Lazy: importing the package (for config or hashing, say) should not import torch.
    if name == "LLM":
        from pagedserve.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pagedserve.sampling import SamplingParams

        return SamplingParams
    if name == "BeamSearchParams":
        from pagedserve.sampling import BeamSearchParams

        return BeamSearchParams
    if name == "EngineConfig":
        from pagedserve.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
