"""OpenAI's wire format: request models, errors, and the engine -> ingress delta messages.

Request models take OpenAI's fields plus vLLM's extras (top_k, min_p, repetition_penalty,
min_tokens, ignore_eos, stop_token_ids, priority, cache_salt, ...). Unknown fields are ignored,
as vLLM does; fields we know but do not implement (echo, suffix, tools, logit_bias, ...) are
rejected with a 400 naming them rather than silently ignored.

Between an engine replica and the ingress, one request's progress travels as small dicts (never
pickled objects of ours, never the whole text again): see ``cluster.outputs.OutputDeltas``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.cluster.outputs import MIN_LOGPROB, OutputDeltas, clamp_logprob, merge_deltas
from pagedserve.sampling import MAX_LOGPROBS, SamplingParams

RETRY_AFTER_S = 1  # what an overloaded server asks clients to wait before retrying


class OpenAIError(Exception):
    """An error that becomes ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        # OpenAI's own type strings: client errors are invalid requests, 5xx are server errors.
        return "server_error" if self.status >= 500 else "invalid_request_error"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_dict(self) -> dict[str, Any]:
        """The engine -> ingress form (see ``OpenAIError.from_dict``)."""
        return {"error": {"status": self.status, "message": self.message, "param": self.param,
                          "code": self.code, "headers": self.headers}}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OpenAIError:
        err = data["error"]
        return cls(err["status"], err["message"], param=err.get("param"), code=err.get("code"),
                   headers=err.get("headers"))  # fmt: skip


def overloaded(message: str) -> OpenAIError:
    """503 with Retry-After: the request was not admitted and may be retried as it is."""
    return OpenAIError(503, message, code="server_overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})


# ---- requests --------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class _GenerationRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    cache_salt: str | None = Field(default=None, min_length=1)
    # vLLM's beam-search extras (and transformers' early_stopping): returns the n best beams
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False

    def check_supported(self) -> None:
        """Raise a 400 for fields we know but do not implement, when they ask for something."""
        if self.logit_bias:
            raise OpenAIError(400, "logit_bias is not supported", param="logit_bias")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        best_of: int | None = None) -> SamplingParams:  # fmt: skip
        """The engine's SamplingParams; raises SamplingParamsError naming a bad field.

        With use_beam_search the beam width is best_of (completions) or n, and an unset
        temperature means 0: beam search is deterministic, any temperature > 0 is refused.
        """
        optional = {"top_k": self.top_k, "min_p": self.min_p, "repetition_penalty": self.repetition_penalty}
        temperature = self.temperature
        if temperature is None:
            temperature = 0.0 if self.use_beam_search else 1.0
        # SamplingParams refuses length_penalty and early_stopping without beam search
        beam = {"length_penalty": self.length_penalty, "early_stopping": self.early_stopping}
        if self.use_beam_search:
            beam |= {"use_beam_search": True, "best_of": best_of}
        return SamplingParams(
            n=self.n, temperature=temperature,
            top_p=1.0 if self.top_p is None else self.top_p, seed=self.seed,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            stop=[] if self.stop is None else self.stop, stop_token_ids=self.stop_token_ids or [],
            include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
            max_tokens=max_tokens, min_tokens=self.min_tokens, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            **{k: v for k, v in optional.items() if v is not None}, **beam,
        )  # fmt: skip

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions. ``prompt``: a string, strings, token ids, or lists of token ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise OpenAIError(400, "echo is not supported", param="echo")
        if self.suffix:
            raise OpenAIError(400, "suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n and not self.use_beam_search:
            raise OpenAIError(400, "best_of other than n is supported with use_beam_search only",
                              param="best_of")  # fmt: skip


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_message(self) -> dict[str, str]:
        """The {"role", "content"} dict a chat template expects; only text content is supported."""
        if self.role == "tool":
            raise OpenAIError(400, "tool messages are not supported", param="messages")
        content = self.content or ""
        if isinstance(content, list):
            for part in content:
                if part.type != "text" or part.text is None:
                    raise OpenAIError(400, f"content parts of type {part.type!r} are not supported",
                                      param="messages")  # fmt: skip
            content = "".join(part.text for part in content)
        # "developer" is OpenAI's newer name for the system role; templates know "system".
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise OpenAIError(400, f"{name} (function calling) is not supported", param=name)
        if self.tool_choice not in (None, "none"):
            raise OpenAIError(400, "tool_choice is not supported", param="tool_choice")
        if self.response_format and self.response_format.get("type") != "text":
            raise OpenAIError(400, "only response_format {\"type\": \"text\"} is supported",
                              param="response_format")  # fmt: skip
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if self.add_generation_prompt and self.continue_final_message:
            raise OpenAIError(400, "add_generation_prompt and continue_final_message are exclusive",
                              param="continue_final_message")  # fmt: skip

    @property
    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise OpenAIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}]", param="top_logprobs")
        return self.top_logprobs or 0


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's shape): either ``prompt`` or chat ``messages``."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for prompt, False for messages (as vLLM)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's shape)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]

__all__ = ["MIN_LOGPROB", "OutputDeltas", "clamp_logprob", "merge_deltas"]  # re-exported: the wire format
