"""The control plane of `pagedserve serve`'s private Ray at Linux's SCHED_IDLE (what it is for:
a CPU host, where the engine's threads share the cores with it; applied on any private Ray).

A one-machine server runs ~15 processes beside the engine: Ray's GCS, raylet, log monitor,
autoscaler monitor, dashboard head and agents, Serve's controller and proxy actor, the admin
dashboard's node probes, and this CLI's driver. At rest they take ~20-25% of one core in short
periodic wake-ups, and on a CPU host each wake-up lands on a core the engine's OpenMP team is
using: a step's parallel region then waits at its barrier for the thread whose core was taken.
Under SCHED_IDLE a process never preempts a normal one when it wakes and gets only what the
normal ones leave (weight 3 against nice 0's 1024), so it runs in the gaps: between steps, while
the engine's threads sleep. Measured on a 2-vCPU Xeon VM with AMX (SmolLM2 bf16, 256-token
prompts one at a time, 30 requests a round, rounds alternated twice): the served prefill step
p50 109 / 110 ms against 139 / 139 with them at SCHED_OTHER (nice 19 instead: 116 / 125), client
TTFT p50 148 / 148 against 184 / 187 ms.

The request path stays as it is: the Serve replicas (the ingress and the engine replicas, and
the engine processes they start), the cluster state actor (routers and replicas call it; it
drops a replica silent for state.STALE_REPLICA_S, which a starved actor must not misjudge), and
Ray's idle workers, any of which may become a replica. So does the raylet (~0.3% of a core):
a process inherits SCHED_IDLE from its parent (SCHED_RESET_ON_FORK resets only real-time
policies and negative nice values), and the raylet starts every new worker, a replacement
replica's among them.
"""

from __future__ import annotations

import logging
import os

import psutil

logger = logging.getLogger(__name__)

# A process whose command line holds one of these (Ray sets a worker's title to "ray::<what>")
# serves requests, or may: it and everything below it keep their policy.
REQUEST_PATH = ("ray::ServeReplica:", "ray::ReplicaStateActor", "ray::IDLE")
SPAWNER = "raylet"  # the program that starts Ray's workers: kept, its children judged one by one


def control_plane(root: int) -> list[psutil.Process]:
    """`root` and the processes below it, less those on the request path (and all below them)
    and the raylet."""
    found: list[psutil.Process] = []
    stack = [psutil.Process(root)]
    while stack:
        proc = stack.pop()
        try:
            cmdline = proc.cmdline()
            children = proc.children()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue  # gone, or not ours to judge: leave it
        if any(marker in " ".join(cmdline) for marker in REQUEST_PATH):
            continue
        if not cmdline or os.path.basename(cmdline[0]) != SPAWNER:
            found.append(proc)
        stack.extend(children)
    return found


def demote(pid: int) -> int:
    """Every thread of process `pid` to SCHED_IDLE (Linux: a policy is a thread's; the threads
    it starts later inherit it). Returns the threads changed."""
    changed = 0
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return 0
    for tid in tids:
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            changed += 1
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    return changed


def idle_control_plane(root: int | None = None) -> list[int]:
    """Put the control plane under `root` (default: this process, the private Ray's driver) at
    SCHED_IDLE. Returns the pids demoted; where the kernel refuses, logs it and changes nothing
    further (the server runs as it would have)."""
    if not hasattr(os, "SCHED_IDLE"):  # not Linux
        return []
    demoted: list[int] = []
    for proc in control_plane(os.getpid() if root is None else root):
        try:
            if demote(proc.pid):
                demoted.append(proc.pid)
        except PermissionError as exc:
            logger.warning("the control plane stays at its scheduling policy (%s)", exc)
            break
    return demoted
