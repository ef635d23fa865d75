"""The engine in a process of its own (vLLM's EngineCore): scheduler, model, sampler, detokenizer.

An engine replica's process also runs Ray's core worker and Serve's event loops, which stream
every token to the ingress. Sharing that process's GIL, the engine's step loop waited for it
whenever one of those threads held it and lost its core (measured served on 2 cores: the model
thread slept 26.7% of a step on the GIL when pinned, and waited 13-19% for its core unpinned).
Here the loop runs in a child process with a GIL of its own, optionally pinned to cores, and
talks to the replica over a socket pair: one msgpack frame per step carries every request's
delta (``OutputDeltas``), the step's KV events and the engine's figures; the replica sends
requests, aborts and admin calls. Nothing is pickled; the child exits when the replica goes.

``EngineProcess`` (the replica's side) has ``AsyncEngine``'s interface; ``generate_deltas``
yields the deltas the ingress takes. ``python -m pagedserve.cluster.engine_process FD`` is the
child.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import msgpack

from pagedserve.cluster.outputs import OutputDeltas, merge_deltas

logger = logging.getLogger(__name__)

HEADER = struct.Struct("!I")  # a frame: its payload's length, then the msgpack payload
IDLE_WAIT_S = 0.5  # an idle child wakes this often to notice a vanished parent
START_TIMEOUT_S = 600.0  # model load (a GGUF conversion can take minutes on first use)
STOP_TIMEOUT_S = 30.0
PR_SET_PDEATHSIG = 1
# The nice value a CPU engine's process takes (PAGEDSERVE_CPU_ENGINE_NICE; 0, the default:
# unchanged), see _raise_priority. Opt-in: at -10 on 2 cores the HTTP front shed overload
# seconds late and a multi-node fault test lost its timing (make test, 2026-12-04); the
# benchmark against vLLM (benchmarks/peers.py) sets -10.
ENGINE_NICE = int(os.environ.get("PAGEDSERVE_CPU_ENGINE_NICE", "0"))


class EngineProcessDied(RuntimeError):
    """The engine's process exited; the requests it held are lost (the replica must be replaced)."""


# ---- framing ---------------------------------------------------------------------------------


def _frame(obj: Any) -> bytes:
    payload = msgpack.packb(obj, use_bin_type=True)
    return HEADER.pack(len(payload)) + payload


def _unpack(payload: bytes) -> Any:
    return msgpack.unpackb(payload, raw=False, strict_map_key=False)


class _Frames:
    """Cuts a byte stream into msgpack frames."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        self._buf += data
        out = []
        while len(self._buf) >= HEADER.size:
            (size,) = HEADER.unpack_from(self._buf)
            if len(self._buf) < HEADER.size + size:
                break
            out.append(_unpack(bytes(self._buf[HEADER.size : HEADER.size + size])))
            del self._buf[: HEADER.size + size]
        return out


# ---- errors across the process boundary -------------------------------------------------------


def _error_record(exc: BaseException) -> list[Any]:
    return [type(exc).__name__, str(exc), getattr(exc, "param", None)]


def _error_of(record: list[Any]) -> Exception:
    """The exception a record names, as the replica's handlers expect it (by class)."""
    from pagedserve.cluster.block_manager import RequestTooLong
    from pagedserve.cluster.engine import InvalidPrompt
    from pagedserve.sampling import SamplingParamsError

    kind, message, param = record
    if kind == "SamplingParamsError":
        return SamplingParamsError(param or "", message)
    known = {"InvalidPrompt": InvalidPrompt, "RequestTooLong": RequestTooLong, "ValueError": ValueError}
    return known.get(kind, RuntimeError)(message)


# ---- the replica's side ----------------------------------------------------------------------


class EngineProcess:
    """The replica's handle on the engine's process: ``AsyncEngine``'s interface over a socket.

    Make it with ``await EngineProcess.start(flags, ...)`` on the event loop that will use it.
    """

    def __init__(self, proc: subprocess.Popen, ready: dict[str, Any]) -> None:
        self._proc = proc
        self.pid: int = ready["pid"]
        self._stats = _stats_of(ready["stats"])
        self._streams: dict[str, asyncio.Queue] = {}
        self._calls: dict[str, asyncio.Future] = {}
        self._kv_events: list[list[Any]] = []
        self._transport: asyncio.Transport | None = None
        self._dead: str | None = None  # why the process is gone
        self._loop = asyncio.get_running_loop()
        self._stopping = False

    @classmethod
    async def start(cls, flags: dict[str, Any], *, torch_threads: int = 1,
                    cpus: list[int] | None = None) -> EngineProcess:  # fmt: skip
        """Spawn the child (on ``cpus`` alone when given), load the model there and connect; raises
        what the load raised."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagedserve.cluster.engine_process", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), close_fds=True,
        )  # fmt: skip
        theirs.close()
        try:
            ours.sendall(_frame({"flags": flags, "torch_threads": torch_threads, "cpus": cpus}))
            ready = await asyncio.wait_for(asyncio.to_thread(_read_one, ours), START_TIMEOUT_S)
            if ready.get("t") != "ready":
                raise RuntimeError(f"the engine process failed to start:\n{ready.get('error')}")
        except BaseException:
            proc.kill()
            ours.close()
            raise
        engine = cls(proc, ready)
        ours.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.create_unix_connection(lambda: _Protocol(engine), sock=ours)
        return engine

    # the AsyncEngine interface ---------------------------------------------------------------

    async def generate_deltas(self, prompt: Any, params: Any = None, request_id: str | None = None,
                              **kwargs: Any) -> AsyncIterator[dict[str, Any]]:  # fmt: skip
        """Yield the request's deltas (``OutputDeltas``) as steps advance it; the last has
        finished=True. Leaving early (a client disconnect) aborts it and frees its blocks."""
        from pagedserve.cluster.engine import relay
        from pagedserve.sampling import SamplingParams

        if self._dead:
            raise EngineProcessDied(self._dead)
        request_id = request_id or uuid.uuid4().hex
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        params = params if params is not None else SamplingParams()
        self._send(["add", request_id, prompt, params.to_dict(), kwargs])
        # when the consumer fell behind, one merged delta goes on instead of several
        items = relay(stream, merge_deltas, lambda delta: delta["finished"], lambda: self.abort(request_id))
        try:
            async with aclosing(items):
                async for item in items:
                    yield item
        finally:
            self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._send(["abort", request_id])

    async def block_states(self) -> str:
        """The KV pool's blocks as ``BlockManager.block_states`` describes them, as of now."""
        return await self._call("block_states")

    async def reset_prefix_cache(self) -> int:
        """Forget every cached-free block's content; returns how many blocks were dropped."""
        return await self._call("reset_prefix_cache")

    def stats(self) -> Any:
        """The engine's figures as of its last step."""
        return self._stats

    def take_kv_events(self) -> list[tuple[str, list[int]]]:
        events, self._kv_events = self._kv_events, []
        return [(kind, hashes) for kind, hashes in events]

    def request_kv_snapshot(self) -> None:
        """Have the next KV events start with every block hash the prefix cache holds."""
        self._send(["snapshot"])

    @property
    def failure(self) -> str | None:
        """None while the process runs, else why it is gone."""
        return self._dead

    def shutdown(self) -> None:
        """Stop the child (it finishes its step, then exits) and wait for it; kill it past 30 s.
        Callable from any thread (the replica's ``__del__`` runs it in one)."""
        self._stopping = True
        if self._proc.poll() is None and not self._dead:
            try:
                on_loop = asyncio.get_running_loop() is self._loop
            except RuntimeError:
                on_loop = False
            try:
                if on_loop:
                    self._send(["shutdown"])
                else:
                    self._loop.call_soon_threadsafe(self._send, ["shutdown"])
            except RuntimeError:  # the loop is closed: no polite way left
                self._proc.terminate()
        try:
            self._proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    # internals --------------------------------------------------------------------------------

    async def _call(self, name: str) -> Any:
        if self._dead:
            raise EngineProcessDied(self._dead)
        call_id = uuid.uuid4().hex
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            self._send(["call", call_id, name])
            return await future
        finally:
            self._calls.pop(call_id, None)

    def _send(self, message: list[Any]) -> None:
        if self._transport is not None and not self._dead:
            self._transport.write(_frame(message))

    def _on_message(self, msg: dict[str, Any]) -> None:
        streams = self._streams
        for request_id, delta in msg.get("o", ()):
            stream = streams.get(request_id)
            if stream is not None:
                stream.put_nowait(delta)
        for request_id, record in msg.get("e", ()):
            stream = streams.get(request_id)
            if stream is not None:
                stream.put_nowait(_error_of(record))
        if "s" in msg:
            self._stats = _stats_of(msg["s"])
        if "snapshot" in msg:
            self._kv_events = [["stored", msg["snapshot"]]]
        self._kv_events.extend(msg.get("k", ()))
        for call_id, ok, value in msg.get("r", ()):
            future = self._calls.get(call_id)
            if future is not None and not future.done():
                future.set_result(value) if ok else future.set_exception(_error_of(value))

    def _on_lost(self) -> None:
        code = self._proc.poll()
        self._dead = f"the engine process {self.pid} exited" + (f" (code {code})" if code is not None else "")
        if self._stopping:
            logger.info("%s", self._dead)
        else:
            logger.error("%s; failing its %d requests", self._dead, len(self._streams))
        for stream in self._streams.values():
            stream.put_nowait(EngineProcessDied(self._dead))
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineProcessDied(self._dead))


class _Protocol(asyncio.Protocol):
    def __init__(self, engine: EngineProcess) -> None:
        self.engine = engine
        self.frames = _Frames()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.engine._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        for msg in self.frames.feed(data):
            self.engine._on_message(msg)

    def connection_lost(self, exc: Exception | None) -> None:
        self.engine._on_lost()


def _read_one(sock: socket.socket) -> Any:
    frames = _Frames()
    while True:
        data = sock.recv(1 << 16)
        if not data:
            return {"t": "failed", "error": "the engine process exited while starting"}
        got = frames.feed(data)
        if got:
            return got[0]


def _stats_of(data: dict[str, Any]) -> Any:
    from pagedserve.cluster.engine import EngineStats

    return EngineStats(**data)


# ---- the child ---------------------------------------------------------------------------------


class _Child:
    """The child's loop: take commands between steps, step, send one frame per step."""

    def __init__(self, sock: socket.socket, engine: Any) -> None:
        self.sock = sock
        self.engine = engine
        self.frames = _Frames()
        self.deltas: dict[str, OutputDeltas] = {}
        self.out: list[list[Any]] = []
        self.errors: list[list[Any]] = []
        self.results: list[list[Any]] = []
        self.snapshot: list[int] | None = None
        self.stopping = False

    def run(self) -> None:
        engine = self.engine
        while not self.stopping:
            busy = engine.has_unfinished_requests()
            if not self._take_commands(0.0 if busy else IDLE_WAIT_S):
                return  # the replica is gone
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except Exception as exc:  # a step failure fails the running requests, not the engine
                    logger.exception("engine step failed")
                    message = f"engine step failed: {exc}"
                    for out in engine.fail_all(message):
                        self._fail(out.request_id, RuntimeError(message))
                else:
                    for out in outputs:
                        self._output(out)
            self._flush()

    def _take_commands(self, timeout: float) -> bool:
        readable, _, _ = select.select([self.sock], [], [], timeout)
        while readable:
            data = self.sock.recv(1 << 20)
            if not data:
                return False
            for cmd in self.frames.feed(data):
                self._apply(cmd)
            readable, _, _ = select.select([self.sock], [], [], 0.0)
        return True

    def _apply(self, cmd: list[Any]) -> None:
        from pagedserve.sampling import SamplingParams

        engine = self.engine
        kind = cmd[0]
        if kind == "add":
            _, request_id, prompt, params, kwargs = cmd
            try:
                engine.add_request(request_id, prompt, SamplingParams.from_dict(params), **kwargs)
                self.deltas[request_id] = OutputDeltas()
            except Exception as exc:  # reported to the caller, never kills the loop
                self.errors.append([request_id, _error_record(exc)])
        elif kind == "abort":
            out = engine.abort_request(cmd[1])
            if out is not None:
                self._output(out)
        elif kind == "call":
            _, call_id, name = cmd
            try:
                if name == "block_states":
                    value: Any = engine.block_manager.block_states()
                elif name == "reset_prefix_cache":
                    value = engine.block_manager.reset_prefix_cache()
                else:
                    raise ValueError(f"unknown engine call {name!r}")
                self.results.append([call_id, True, value])
            except Exception as exc:
                self.results.append([call_id, False, _error_record(exc)])
        elif kind == "snapshot":
            engine.take_kv_events()  # superseded by the snapshot
            self.snapshot = list(engine.block_manager.cached)
        elif kind == "shutdown":
            self.stopping = True

    def _output(self, out: Any) -> None:
        deltas = self.deltas.get(out.request_id)
        if deltas is None:
            return
        if out.error is not None and out.finished:
            self._fail(out.request_id, RuntimeError(out.error))
            return
        self.out.append([out.request_id, deltas.delta(out)])
        if out.finished:
            del self.deltas[out.request_id]

    def _fail(self, request_id: str, exc: Exception) -> None:
        self.deltas.pop(request_id, None)
        self.errors.append([request_id, _error_record(exc)])

    def _flush(self) -> None:
        """One frame: this round's deltas, errors, call results, KV events and the figures."""
        msg: dict[str, Any] = {"s": dataclasses.asdict(self.engine.stats())}
        if self.out:
            msg["o"], self.out = self.out, []
        if self.errors:
            msg["e"], self.errors = self.errors, []
        if self.results:
            msg["r"], self.results = self.results, []
        if self.snapshot is not None:
            msg["snapshot"], self.snapshot = self.snapshot, None
        events = self.engine.take_kv_events()
        if events:
            msg["k"] = events
        self.sock.sendall(_frame(msg))


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the replica's process dies (a killed replica never
    leaves an engine holding the cores and memory)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _raise_priority(nice: int) -> None:
    """Give every thread of this process (and, by inheritance, every thread it starts later: the
    OpenMP team, the decode pool's helpers) the nice value `nice`. On a CPU node the engine's
    step is the critical path and shares its cores with the HTTP proxy, the ingress and Ray's
    processes: measured served on 2 cores (SmolLM2 fp32, concurrency 16, `benchmarks/peers.py`'s
    W1), the model thread waited for a core 19% of the time at nice 0; at -10, alternating runs
    against one server, 103.2 / 103.6 -> 112.0 / 115.3 output tok/s, ITL p50 89 -> 80 ms. Where
    the process may not raise its priority (no CAP_SYS_NICE) it logs that and runs as it is."""
    if nice == 0:
        return
    try:
        for tid in os.listdir("/proc/self/task"):
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)  # Linux: per thread
    except (OSError, ValueError) as exc:
        logger.info("engine priority unchanged (nice %d: %s)", nice, exc)


def main(argv: list[str]) -> int:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the replica's to handle
    sock = socket.socket(fileno=int(argv[0]))
    sock.setblocking(True)
    init = _read_one(sock)
    if not isinstance(init, dict) or "flags" not in init:
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine: %(message)s")
    try:
        if init.get("cpus"):
            os.sched_setaffinity(0, init["cpus"])
        import torch

        if not torch.cuda.is_available():
            _raise_priority(ENGINE_NICE)
        from pagedserve.cluster.engine import Engine
        from pagedserve.config import EngineConfig

        torch.set_num_threads(init["torch_threads"])
        started = time.monotonic()
        engine = Engine(EngineConfig.from_flags(**init["flags"]))
    except BaseException:
        sock.sendall(_frame({"t": "failed", "error": traceback.format_exc()}))
        return 1
    logger.info("engine process %d ready in %.1f s (cpus %s, nice %d)", os.getpid(),
                time.monotonic() - started, sorted(os.sched_getaffinity(0)),
                os.getpriority(os.PRIO_PROCESS, 0))  # fmt: skip
    sock.sendall(_frame({"t": "ready", "pid": os.getpid(), "stats": dataclasses.asdict(engine.stats())}))
    try:
        _Child(sock, engine).run()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the replica is gone
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
