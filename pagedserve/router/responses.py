"""OpenAI responses from engine deltas: choices, logprob shapes, usage, one JSON body or SSE.

A request's engine streams (one per prompt) are merged as deltas arrive; each delta is folded
into its ``Choice``. Streamed text holds back max(len(stop)) - 1 characters until the choice
ends, so no part of a stop string is ever sent; streams end with ``data: [DONE]``, after an
error event if one comes once the headers are sent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedserve.router.protocol import OpenAIError
from pagedserve.sampling import SamplingParams

logger = logging.getLogger(__name__)


class Choice:
    """One OpenAI choice assembled from engine deltas, and how much of it has been streamed."""

    __slots__ = ("index", "text", "sent", "token_ids", "logprobs", "logprobs_sent", "finish_reason",
                 "stop_reason", "finish_sent", "text_offset")  # fmt: skip

    def __init__(self, index: int) -> None:
        self.index = index
        self.text = ""
        self.sent = 0  # characters of text already streamed
        self.token_ids: list[int] = []
        self.logprobs: list[list[list[Any]]] = []
        self.logprobs_sent = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.finish_sent = False
        self.text_offset = 0  # completions logprobs: offset of the next token's text

    def apply(self, sample: dict[str, Any]) -> None:
        """Fold in one sample delta of ``OutputDeltas``."""
        self.text = self.text[: sample["text_start"]] + sample["text"]
        self.token_ids.extend(sample["token_ids"])
        if sample["logprobs"]:
            self.logprobs.extend(sample["logprobs"])
        if sample["finish_reason"] is not None:
            self.finish_reason = sample["finish_reason"]
            self.stop_reason = sample["stop_reason"]

    def release_text(self, holdback: int) -> str:
        """The text not yet streamed, less the last ``holdback`` characters until the choice ends.

        Holding back max(len(stop)) - 1 characters means a stop string is never partly sent: the
        engine cuts text at a stop string that ends in the newest characters, and such a string
        starts no earlier than ``len(stop) - 1`` characters before them.
        """
        end = len(self.text) if self.finish_reason is not None else len(self.text) - holdback
        if end <= self.sent:
            return ""
        out = self.text[self.sent : end]
        self.sent = end
        return out

    def take_logprobs(self) -> list[list[list[Any]]]:
        out = self.logprobs[self.logprobs_sent :]
        self.logprobs_sent = len(self.logprobs)
        return out

    def take_finish(self) -> str | None:
        """The finish reason, once: when it is known and not yet sent."""
        if self.finish_reason is None or self.finish_sent:
            return None
        self.finish_sent = True
        return self.finish_reason


def _top(entry: list[list[Any]], k: int) -> list[list[Any]]:
    # Top entries carry ranks 1..k; the sampled token (first) is among them only if its rank <= k.
    return sorted((e for e in entry if e[2] is not None and e[2] <= k), key=lambda e: e[2])[:k]


def completion_logprobs(entries: list[list[list[Any]]], k: int, token_text: Any, offset: int
                        ) -> tuple[dict[str, Any], int]:  # fmt: skip
    """Completions' logprobs object for ``entries``, text offsets from ``offset``; returns the next offset.

    As OpenAI's legacy format: each top_logprobs dict holds the top ``k`` and the sampled token.
    """
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for entry in entries:
        tid, logprob, _ = entry[0]
        text = token_text(tid)
        tokens.append(text)
        token_logprobs.append(logprob)
        offsets.append(offset)
        offset += len(text)
        top = {token_text(t): lp for t, lp, _ in _top(entry, k)}
        top[text] = logprob  # the sampled token's own figure wins where two tokens decode alike
        top_logprobs.append(top)
    out = {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }
    return out, offset


def chat_logprobs(entries: list[list[list[Any]]], k: int, token_text: Any) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content``: per token {token, logprob, bytes, top_logprobs (the top k)}."""

    def item(tid: int, logprob: float) -> dict[str, Any]:
        text = token_text(tid)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [
        item(entry[0][0], entry[0][1]) | {"top_logprobs": [item(t, lp) for t, lp, _ in _top(entry, k)]}
        for entry in entries
    ]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


async def first_item(stream: AsyncIterator[dict[str, Any]]) -> dict[str, Any]:
    """The stream's first item; an engine stream always has one (an output or an error)."""
    try:
        return await anext(stream)
    except StopAsyncIteration:
        raise OpenAIError(500, "the engine ended a request without output", code="internal_error") from None


async def prepend(
    first: dict[str, Any], rest: AsyncIterator[dict[str, Any]]
) -> AsyncIterator[dict[str, Any]]:
    """``first``, then the rest of the stream it came from (closed when this one is)."""
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


async def merge(streams: list[AsyncIterator[dict[str, Any]]]) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """(stream number, item) from all streams as items arrive; the first error ends all of them."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(k: int, stream: AsyncIterator[dict[str, Any]]) -> None:
        try:
            async with aclosing(stream):
                async for item in stream:
                    queue.put_nowait((k, item))
            queue.put_nowait((k, done))
        except Exception as exc:
            queue.put_nowait((k, exc))

    tasks = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            k, item = await queue.get()
            if item is done:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield k, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class ResponseBuilder:
    """One request's response, as a single JSON body or as server-sent events."""

    def __init__(
        self,
        kind: str,
        request_id: str,
        model_name: str,
        token_text: Callable[[int], str],
        body: Any,
        params: SamplingParams,
        prompt_lens: list[int],
        num_logprobs: int | None,
    ) -> None:
        self.kind = kind  # "text_completion" | "chat.completion"
        self.request_id = request_id
        self.model_name = model_name
        self.token_text = token_text
        self.body = body
        self.n = params.n
        self.prompt_lens = prompt_lens
        self.num_logprobs = num_logprobs
        self.holdback = max((len(s) for s in params.stop), default=1) - 1
        self.choices = [Choice(i) for i in range(len(prompt_lens) * params.n)]
        self.cached = [0] * len(prompt_lens)
        self.created = int(time.time())

    def apply(self, k: int, delta: dict[str, Any]) -> list[Choice]:
        self.cached[k] = max(self.cached[k], delta["num_cached_tokens"])
        changed = []
        for sample in delta["outputs"]:
            choice = self.choices[k * self.n + sample["index"]]
            choice.apply(sample)
            changed.append(choice)
        return changed

    def usage(self) -> dict[str, Any]:
        return usage(sum(self.prompt_lens), sum(len(c.token_ids) for c in self.choices), sum(self.cached))

    def logprobs(self, choice: Choice, entries: list) -> Any:
        if self.num_logprobs is None:
            return None
        if self.kind == "chat.completion":
            return {"content": chat_logprobs(entries, self.num_logprobs, self.token_text)}
        out, choice.text_offset = completion_logprobs(entries, self.num_logprobs, self.token_text,
                                                      choice.text_offset)  # fmt: skip
        return out

    async def respond(self, streams: list[AsyncIterator[dict[str, Any]]]) -> Response:
        if self.body.stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(self.events(streams), media_type="text/event-stream", headers=headers)
        async for k, delta in merge(streams):
            self.apply(k, delta)
        return JSONResponse(self.body_json())

    def body_json(self) -> dict[str, Any]:
        choices = []
        for c in self.choices:
            item: dict[str, Any] = {"index": c.index}
            if self.kind == "chat.completion":
                item["message"] = {"role": "assistant", "content": c.text}
            else:
                item["text"] = c.text
            item |= {"logprobs": self.logprobs(c, c.take_logprobs()), "finish_reason": c.finish_reason,
                     "stop_reason": c.stop_reason}  # fmt: skip
            choices.append(item)
        return {"id": self.request_id, "object": self.kind, "created": self.created,
                "model": self.model_name, "choices": choices, "usage": self.usage()}  # fmt: skip

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        kind = "chat.completion.chunk" if self.kind == "chat.completion" else "text_completion"
        data: dict[str, Any] = {"id": self.request_id, "object": kind, "created": self.created,
                                "model": self.model_name, "choices": choices}  # fmt: skip
        if self.body.include_usage or self.body.continuous_usage:
            data["usage"] = (
                usage if usage is not None else (self.usage() if self.body.continuous_usage else None)
            )
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    def choice_delta(self, choice: Choice) -> dict[str, Any] | None:
        """The streamed piece of one choice: new text (less the stop hold-back), logprobs, finish."""
        text = choice.release_text(self.holdback)
        entries = choice.take_logprobs()
        finish = choice.take_finish()
        if not text and not entries and finish is None:
            return None
        item: dict[str, Any] = {"index": choice.index}
        if self.kind == "chat.completion":
            item["delta"] = {"content": text} if text else {}
        else:
            item["text"] = text
        item |= {"logprobs": self.logprobs(choice, entries) if entries else None, "finish_reason": finish}
        if finish is not None:
            item["stop_reason"] = choice.stop_reason
        return item

    async def events(self, streams: list[AsyncIterator[dict[str, Any]]]) -> AsyncIterator[str]:
        try:
            if self.kind == "chat.completion":
                for c in self.choices:
                    role = {"role": "assistant", "content": ""}
                    yield self.chunk(
                        [{"index": c.index, "delta": role, "logprobs": None, "finish_reason": None}]
                    )
            async for k, delta in merge(streams):
                for choice in self.apply(k, delta):
                    item = self.choice_delta(choice)
                    if item is not None:
                        yield self.chunk([item])
            if self.body.include_usage:
                yield self.chunk([], usage=self.usage())
        except OpenAIError as exc:
            yield f"data: {json.dumps(exc.body())}\n\n"
        except Exception as exc:  # headers are sent: the error can only travel in the stream
            logger.exception("stream failed")
            err = OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")
            yield f"data: {json.dumps(err.body())}\n\n"
        yield "data: [DONE]\n\n"
