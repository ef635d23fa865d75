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

Only the processes named here move (an allow list: a process it does not know, such as a
tensor-parallel rank's worker or a user's actor, keeps its policy). The request path stays as it
is: the Serve replicas and the engine processes they start, the ranks, the cluster state actor
(it drops a replica silent for state.STALE_REPLICA_S, which a starved actor must not misjudge),
Ray's idle workers (any may become a replica), and the raylet (~0.3% of a core): a process
inherits SCHED_IDLE from its parent (SCHED_RESET_ON_FORK resets only real-time policies and
negative nice values), and the raylet starts every new worker, a replacement replica's too.
"""

from __future__ import annotations

import logging
import os

import psutil

logger = logging.getLogger(__name__)

# The control plane: programs (argv[0]), Python scripts run by the interpreter, and Ray actors
# (Ray sets a worker's title, its whole command line, to "ray::<Class>...").
PROGRAMS = ("gcs_server",)
SCRIPTS = ("log_monitor.py", "monitor.py", "dashboard.py")
ACTORS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent", "ray::ServeController", "ray::ProxyActor",
          "ray::NodeProbe")  # fmt: skip


def _is_control_plane(cmdline: list[str]) -> bool:
    if not cmdline:
        return False
    if cmdline[0].startswith(ACTORS) or os.path.basename(cmdline[0]) in PROGRAMS:
        return True
    script = next((a for a in cmdline[1:] if not a.startswith("-")), "")
    return os.path.basename(cmdline[0]).startswith("python") and os.path.basename(script) in SCRIPTS


def control_plane(root: int) -> list[psutil.Process]:
    """`root` (the driver) and the control plane's processes below it."""
    found = [psutil.Process(root)]
    for proc in found[0].children(recursive=True):
        try:
            if _is_control_plane(proc.cmdline()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue  # gone, or not ours to judge: leave it
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
