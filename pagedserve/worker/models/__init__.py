"""Model registry: Hugging Face architecture name -> our implementation over paged attention."""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from pagedserve.worker.models.gemma3 import Gemma3ForCausalLM
from pagedserve.worker.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


class UnsupportedModel(ValueError):
    """The config names no architecture this engine implements."""


def get_model_class(config: PretrainedConfig) -> type[nn.Module]:
    """The class implementing the first supported entry of config.architectures.

    Raises UnsupportedModel naming the architectures found and the ones supported.
    """
    architectures = list(getattr(config, "architectures", None) or [])
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise UnsupportedModel(
        f"model architecture {architectures or '(none in config.json)'} is not supported; "
        f"supported: {sorted(MODEL_REGISTRY)}"
    )
