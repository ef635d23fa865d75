"""The OpenAI-compatible HTTP API (FastAPI), served by the ingress deployment.

Routes: POST /v1/completions and /v1/chat/completions (streamed as server-sent events or not),
GET /v1/models, /health, /metrics, and vLLM's POST /tokenize and /detokenize.

The ingress validates a request, applies the chat template, tokenizes once, computes the prompt's
block hashes (the router's input) and streams the engine's deltas back in OpenAI's format.

Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``:

- 400 bad parameters, including request validation errors (mapped to 400 as vLLM does, with
  ``param`` naming the field) and a prompt that, with max_tokens, exceeds max_model_len;
- 401 a missing or wrong API key (``Authorization: Bearer``) on every route but /health and
  /metrics, when the server has one;
- 404 an unknown model or route; 408 a body not received within ``body_timeout_s`` (slow
  clients); 413 a body over ``max_body_bytes``;
- 503 with Retry-After when the engine replicas' queues are full (backpressure, never OOM);
- 500 for anything unexpected; the server keeps running.

A client that disconnects cancels its request; the engine aborts it and frees its blocks.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from ray.exceptions import TaskCancelledError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from transformers import PreTrainedTokenizerBase

from pagedserve.cluster.hashing import hash_blocks
from pagedserve.router.metrics import CONTENT_TYPE, IngressMetrics
from pagedserve.router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    TokenizeRequest,
)
from pagedserve.router.responses import ResponseBuilder, first_item, prepend
from pagedserve.sampling import MAX_LOGPROBS, MAX_NUM_SEQUENCES, SamplingParams, SamplingParamsError

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20  # ~1M prompt tokens as JSON ids; far beyond any context we serve
BODY_TIMEOUT_S = 30.0  # a request body trickled slower than this (slow-loris) gets a 408
OPEN_PATHS = ("/health", "/metrics")  # answered without an API key, as vLLM does
ADMIN_PATHS = ("/dashboard", "/admin/")  # guarded by the admin token instead (router/dashboard)


@dataclass(frozen=True, slots=True)
class Limits:
    """Request limits (ServeConfig's of the same names): past them a 400 naming the parameter, a
    413 for the body, a 408 for a body that does not arrive in time. The defaults are the
    engine's own caps, so that only a deployment that wants less needs to say so."""

    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout_s: float = BODY_TIMEOUT_S
    max_n: int = MAX_NUM_SEQUENCES
    max_logprobs: int = MAX_LOGPROBS
    max_output_tokens: int | None = None
    max_prompt_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the ingress knows of the served model; the same figures the engine replicas use."""

    name: str
    root: str
    max_model_len: int
    block_size: int
    vocab_size: int


class EngineClient(Protocol):
    """The ingress's way to the engine replicas."""

    def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream the deltas (``protocol.OutputDeltas``) or one {"error": ...} dict for one request.

        Raises OpenAIError(503) when no replica can take it. Closing the iterator early aborts it.
        """
        ...

    async def engine_health(self) -> None:
        """Raise OpenAIError(503) unless the engine replicas answer."""
        ...

    async def render_metrics(self) -> bytes:
        """The Prometheus text for /metrics."""
        ...


def build_api(model: ModelInfo, tokenizer: PreTrainedTokenizerBase, client: EngineClient,
              metrics: IngressMetrics, *, api_key: str | None = None, limits: Limits = Limits(),
              dashboard: tuple[Any, str] | None = None) -> FastAPI:  # fmt: skip
    """The FastAPI app of the OpenAI-compatible API over ``client``; with ``dashboard`` (a
    ``DashboardService`` and the admin token) also the admin dashboard and its API."""
    server = OpenAIServer(model, tokenizer, client, metrics, limits)
    app = FastAPI(title="pagedserve", version="0.1.0")
    app.add_middleware(RequestGuard, api_key=api_key, max_body_bytes=limits.max_body_bytes,
                       body_timeout_s=limits.body_timeout_s)  # fmt: skip

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(SamplingParamsError)
    async def _sampling_error(_: Request, exc: SamplingParamsError) -> JSONResponse:
        return error_response(OpenAIError(400, str(exc), param=exc.param))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 408: "request_timeout",
                413: "request_too_large"}.get(exc.status_code)  # fmt: skip
        return error_response(OpenAIError(exc.status_code, str(exc.detail), code=code))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("request failed")
        return error_response(
            OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")
        )

    @app.get("/health")
    async def health() -> Response:
        await client.engine_health()
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(await client.render_metrics(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        server.check_model(model_id)
        return server.model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await server.chat_completions(body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return server.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return server.detokenize(body)

    if dashboard is not None:
        from pagedserve.router.dashboard import install_dashboard

        install_dashboard(app, *dashboard)
    return app


def error_response(exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def validation_error(exc: RequestValidationError) -> OpenAIError:
    """A pydantic validation error as OpenAI's 400, ``param`` naming the first bad field."""
    errors = exc.errors()
    if not errors:
        return OpenAIError(400, "invalid request")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return OpenAIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
    names = [part for part in loc if not part.isdigit()]
    where = ".".join(loc)
    return OpenAIError(400, f"{where}: {first.get('msg')}" if where else str(first.get("msg")),
                       param=names[0] if names else None)  # fmt: skip


class RequestGuard:
    """ASGI middleware run before routing: the API key check, the body size limit, and the time
    the whole body may take to arrive (a client trickling it gets a 408, not a held slot)."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int,
                 body_timeout_s: float = BODY_TIMEOUT_S) -> None:  # fmt: skip
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        path = scope["path"]
        if (self.api_key is not None and path not in OPEN_PATHS and not path.startswith(ADMIN_PATHS)
                and not self._authorized(headers)):  # fmt: skip
            exc = OpenAIError(401, "missing or incorrect API key (send Authorization: Bearer <key>)",
                              code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
            await error_response(exc)(scope, receive, send)
            return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await error_response(self._too_large())(scope, receive, send)
            return
        received = 0
        body_done = False
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s

        async def limited_receive() -> Message:
            # A body sent without Content-Length (chunked) is counted as it arrives. Until the
            # body is complete each wait is bounded by the deadline; after it, receive() waits for
            # the client's disconnect during a stream, unbounded.
            nonlocal received, body_done
            if body_done:
                try:
                    return await receive()
                except TaskCancelledError:  # Serve cancels the proxy's receive when the client leaves
                    return {"type": "http.disconnect"}
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except asyncio.TimeoutError:
                raise StarletteHTTPException(
                    408, f"the request body did not arrive within {self.body_timeout_s:g} s"
                ) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise StarletteHTTPException(413, self._too_large().message)
                body_done = not message.get("more_body", False)
            return message

        await self.app(scope, limited_receive, send)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)

    def _too_large(self) -> OpenAIError:
        return OpenAIError(413, f"the request body is larger than {self.max_body_bytes} bytes",
                           code="request_too_large")  # fmt: skip


class OpenAIServer:
    """The endpoints' logic: prompts to engine requests, engine deltas to OpenAI responses."""

    def __init__(self, model: ModelInfo, tokenizer: PreTrainedTokenizerBase, client: EngineClient,
                 metrics: IngressMetrics, limits: Limits = Limits()) -> None:  # fmt: skip
        self.model = model
        self.limits = limits
        self.tokenizer = tokenizer
        self.client = client
        self.metrics = metrics
        self._token_texts: dict[int, str] = {}
        self._created = int(time.time())

    # ---- models, tokenizer ---------------------------------------------------------------

    def model_card(self) -> dict[str, Any]:
        m = self.model
        return {"id": m.name, "object": "model", "created": self._created, "owned_by": "pagedserve",
                "root": m.root, "parent": None, "max_model_len": m.max_model_len}  # fmt: skip

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model.name:
            raise OpenAIError(404, f"the model {name!r} does not exist; this server has {self.model.name!r}",
                              param="model", code="model_not_found")  # fmt: skip

    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError(400, "give either prompt or messages", param="prompt")
        if body.messages is not None:
            ids = self.chat_prompt(body.messages, body.add_generation_prompt, body.continue_final_message,
                                   add_special_tokens=bool(body.add_special_tokens))  # fmt: skip
        else:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = self.tokenizer(body.prompt, add_special_tokens=special).input_ids
        strs = self.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": self.model.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        self.check_ids(body.tokens, "tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    def check_ids(self, ids: Sequence[int], param: str) -> None:
        if ids and (min(ids) < 0 or max(ids) >= self.model.vocab_size):
            raise OpenAIError(400, f"token ids must be in [0, {self.model.vocab_size})", param=param)

    # ---- prompts -------------------------------------------------------------------------

    def completion_prompts(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
        """Token ids of each prompt of a completions request (one string, strings, ids, lists of ids)."""
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise OpenAIError(400, "prompt must not be empty", param="prompt")
        if isinstance(prompt[0], int):
            prompt = [prompt]
        out = []
        for p in prompt:
            ids = self.tokenizer(p).input_ids if isinstance(p, str) else list(p)
            if not ids:
                raise OpenAIError(400, "prompt must not be empty", param="prompt")
            self.check_ids(ids, "prompt")
            out.append(ids)
        return out

    def chat_prompt(self, messages: Sequence[Any], add_generation_prompt: bool, continue_final_message: bool,
                    add_special_tokens: bool = False) -> list[int]:  # fmt: skip
        """Token ids of a conversation through the model's chat template (tokenized once, here)."""
        conversation = [m.as_template_message() for m in messages]
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise OpenAIError(400, "this model has no chat template; use /v1/completions", param="messages")
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=False,
            )  # fmt: skip
        except Exception as exc:  # the template's own checks (jinja raise_exception) reject bad turns
            raise OpenAIError(
                400, f"the chat template rejected the messages: {exc}", param="messages"
            ) from exc
        # As vLLM: the template writes the special tokens itself, so none are added on top.
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids
        if not ids:
            raise OpenAIError(400, "the conversation is empty", param="messages")
        return ids

    def check_limits(self, params: SamplingParams, body: Any) -> None:
        """The deployment's request limits (``Limits``) on what SamplingParams already checked."""
        lim = self.limits
        # a beam search's width is best_of (completions) or n (chat): both are checked here
        for name, value in (("n", params.n), ("best_of", getattr(body, "best_of", None))):
            if value is not None and value > lim.max_n:
                raise OpenAIError(400, f"{name} must be at most {lim.max_n} on this server", param=name)
        for name, value in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
            if value is not None and value > lim.max_logprobs:
                param = "top_logprobs" if name == "logprobs" and hasattr(body, "top_logprobs") else name
                raise OpenAIError(400, f"{param} must be at most {lim.max_logprobs} on this server",
                                  param=param)  # fmt: skip
        most = lim.max_output_tokens
        if most is not None and params.max_tokens is not None and params.max_tokens > most:
            param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
            raise OpenAIError(400, f"{param} must be at most {most} on this server", param=param)

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, param: str) -> None:
        lim = self.limits.max_prompt_tokens
        if lim is not None and num_prompt_tokens > lim:
            raise OpenAIError(400, f"the prompt has {num_prompt_tokens} tokens; this server takes at most "
                              f"{lim}", param=param)  # fmt: skip
        limit = self.model.max_model_len
        if num_prompt_tokens >= limit:
            raise OpenAIError(400, f"This model's maximum context length is {limit} tokens. However, your "
                              f"prompt has {num_prompt_tokens} tokens, leaving none to generate.",
                              param=param, code="context_length_exceeded")  # fmt: skip
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise OpenAIError(400, f"This model's maximum context length is {limit} tokens. However, you "
                              f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in "
                              f"the prompt, {max_tokens} for the completion). Please reduce the length of "
                              "the prompt or the completion.",
                              param="max_tokens", code="context_length_exceeded")  # fmt: skip

    def engine_request(self, request_id: str, ids: list[int], params: SamplingParams, body: Any,
                       http: Request) -> dict[str, Any]:  # fmt: skip
        """The request dict the engine deployment (and the router, before it) receives."""
        salt = body.cache_salt
        return {
            "request_id": request_id,
            "prompt_token_ids": ids,
            "params": params.to_dict(),
            "block_hashes": hash_blocks(ids, self.model.block_size, (salt,) if salt else ()),
            "session_id": http.headers.get("x-session-id") or body.user,
            "priority": body.priority,
            "cache_salt": salt,
        }

    # ---- endpoints -----------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, http: Request) -> Response:
        arrival = time.monotonic()
        self.check_model(body.model)
        body.check_supported()
        prompts = self.completion_prompts(body.prompt)
        params = body.sampling_params(body.max_tokens, body.logprobs, body.best_of)
        self.check_limits(params, body)
        for ids in prompts:
            self.check_length(len(ids), params.max_tokens, "prompt")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        requests = [
            self.engine_request(f"{request_id}-{k}", ids, params, body, http) for k, ids in enumerate(prompts)
        ]
        lens = [len(p) for p in prompts]
        response = ResponseBuilder(
            "text_completion", request_id, self.model.name, self.token_text, body, params, lens, body.logprobs
        )
        return await response.respond(await self.start(requests, arrival))

    async def chat_completions(self, body: ChatCompletionRequest, http: Request) -> Response:
        arrival = time.monotonic()
        self.check_model(body.model)
        body.check_supported()
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = body.sampling_params(max_tokens, body.num_logprobs)
        self.check_limits(params, body)
        ids = self.chat_prompt(body.messages, body.add_generation_prompt, body.continue_final_message)
        self.check_length(len(ids), params.max_tokens, "messages")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        requests = [self.engine_request(request_id, ids, params, body, http)]
        response = ResponseBuilder(
            "chat.completion",
            request_id,
            self.model.name,
            self.token_text,
            body,
            params,
            [len(ids)],
            body.num_logprobs,
        )
        return await response.respond(await self.start(requests, arrival))

    # ---- engine streams ------------------------------------------------------------------

    async def start(
        self, requests: list[dict[str, Any]], arrival: float
    ) -> list[AsyncIterator[dict[str, Any]]]:
        """Send the requests and wait for each one's first delta, so that admission errors (overload,
        a pool too small) still get their own status instead of a broken stream."""
        streams = [self.engine_stream(r, arrival) for r in requests]
        tasks = [asyncio.ensure_future(first_item(s)) for s in streams]
        try:
            firsts = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for s in streams:
                await s.aclose()
            raise
        return [prepend(first, s) for first, s in zip(firsts, streams)]

    async def engine_stream(self, request: dict[str, Any], arrival: float) -> AsyncIterator[dict[str, Any]]:
        """One engine request's deltas, with its latencies recorded; an error delta is raised."""
        last: float | None = None
        async with aclosing(self.client.generate(request)) as deltas:
            async for delta in deltas:
                if "error" in delta:
                    raise OpenAIError.from_dict(delta)
                now = time.monotonic()
                if any(o["token_ids"] for o in delta["outputs"]):
                    if last is None:
                        self.metrics.observe_ttft(now - arrival)
                    else:
                        self.metrics.observe_itl(now - last)
                    last = now
                if delta["finished"]:
                    self.metrics.observe_e2e(now - arrival)
                yield delta
