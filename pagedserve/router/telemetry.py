"""Figures for the admin dashboard, measured where they happen.

An engine replica keeps sliding windows of its requests' time to first token and inter-token
latency and of its output token count (``LatencyWindow``, ``RateWindow``) and draws its KV pool
as a block map (``block_map``); each Ray node reports its host and GPU figures (``node_figures``,
NVML through nvidia-ml-py where there are GPUs). All of it is plain data for the state actor.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from typing import Any

WINDOW_S = 10.0  # latency percentiles and token rates cover the last this many seconds
MAX_SAMPLES = 20_000  # per window: a replica streaming faster keeps the newest
MAX_CELLS = 4096  # a block map larger than this draws several blocks per cell

# a cell's state when its blocks are mixed: the one most of them are in; ties go to the busier
_STATE_ORDER = "rsuc."


class LatencyWindow:
    """Latency samples of the last ``window_s`` seconds, with their percentiles."""

    def __init__(self, window_s: float = WINDOW_S, max_samples: int = MAX_SAMPLES) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def add(self, seconds: float, now: float | None = None) -> None:
        self._samples.append((time.monotonic() if now is None else now, seconds))

    def percentiles(self, qs: tuple[float, ...] = (0.5, 0.95),
                    now: float | None = None) -> list[float | None]:  # fmt: skip
        """The nearest-rank percentiles of the window's samples (None each without samples)."""
        now = time.monotonic() if now is None else now
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()
        values = sorted(v for _, v in self._samples)
        if not values:
            return [None for _ in qs]
        return [values[max(0, math.ceil(q * len(values)) - 1)] for q in qs]


class RateWindow:
    """The rate of a cumulative count over the last ``window_s`` seconds."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._points: deque[tuple[float, int]] = deque()

    def rate(self, total: int, now: float | None = None) -> float:
        """Record ``total`` (the count now) and return its growth per second over the window."""
        now = time.monotonic() if now is None else now
        self._points.append((now, total))
        while len(self._points) > 2 and self._points[1][0] <= now - self.window_s:
            self._points.popleft()
        t0, c0 = self._points[0]
        return (total - c0) / (now - t0) if now > t0 else 0.0


def block_map(states: str, max_cells: int = MAX_CELLS) -> dict[str, Any]:
    """A pool's block states (``BlockManager.block_states``) as at most ``max_cells`` cells.

    Returns {"num_blocks", "blocks_per_cell", "cells", "counts"}: each character of "cells"
    covers ``blocks_per_cell`` consecutive blocks and is the state most of them are in; "counts"
    is the exact number of blocks in each state.
    """
    per_cell = max(1, -(-len(states) // max_cells))
    if per_cell == 1:
        cells = states
    else:
        out = []
        for start in range(0, len(states), per_cell):
            tally = Counter(states[start : start + per_cell])
            out.append(max(tally, key=lambda s: (tally[s], -_STATE_ORDER.index(s))))
        cells = "".join(out)
    counts = Counter(states)
    return {"num_blocks": len(states), "blocks_per_cell": per_cell, "cells": cells,
            "counts": {state: counts.get(state, 0) for state in _STATE_ORDER}}  # fmt: skip


def gpu_devices() -> list[dict[str, Any]]:
    """Each local GPU's utilisation and memory through NVML; [] where there is none."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # no driver, no GPU (NVMLError_LibraryNotFound on this kind of host)
        return []
    try:
        devices = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            util = pynvml.nvmlDeviceGetUtilizationRates(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            devices.append({
                "index": index, "name": name.decode() if isinstance(name, bytes) else name,
                "util_percent": util.gpu, "mem_used_bytes": memory.used, "mem_total_bytes": memory.total,
            })  # fmt: skip
        return devices
    finally:
        pynvml.nvmlShutdown()


def node_figures() -> dict[str, Any]:
    """This host's CPU and memory use and its GPUs: {"host": {...}, "gpu_devices": [...]}."""
    import psutil

    memory = psutil.virtual_memory()
    host = {"cpu_percent": psutil.cpu_percent(interval=None),
            "mem_used_bytes": memory.total - memory.available, "mem_total_bytes": memory.total}  # fmt: skip
    return {"host": host, "gpu_devices": gpu_devices()}
