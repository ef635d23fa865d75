"""The private Ray's control plane at SCHED_IDLE: which processes move, which keep their policy,
and what a moved process starts later (checked in the kernel's own /proc view of real processes)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pagedserve.cluster.control_plane import _is_control_plane, idle_control_plane

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")

# A tree shaped like `pagedserve serve`'s: a driver that starts GCS and a raylet; the raylet
# starts a Serve replica (which starts its engine process), Serve's controller, a tensor-parallel
# rank, an idle worker, and later another worker. Ray titles a worker "ray::<what>" (its whole
# command line); the roles here carry those titles and program names in argv[0], which is what
# the demotion reads.
TREE = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    PYTHON = os.environ["TREE_PYTHON"]  # a child titled "raylet" takes sys.executable from argv[0]
    def start(*args, argv0=PYTHON, stdout=subprocess.DEVNULL, **kw):
        return subprocess.Popen([argv0, __file__, *args], executable=PYTHON, stdout=stdout, **kw)
    role = sys.argv[1]
    if role == "driver":
        daemon = start("leaf", argv0="/opt/ray/gcs_server")
        raylet = start("raylet", argv0="/opt/ray/raylet", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                       text=True)
        pids = json.loads(raylet.stdout.readline())
        pids.update(daemon=daemon.pid, raylet=raylet.pid)
        print(json.dumps(pids), flush=True)
        for line in sys.stdin:  # relay: start a worker, then quit
            raylet.stdin.write(line)
            raylet.stdin.flush()
            print(raylet.stdout.readline().strip(), flush=True)
    elif role == "raylet":
        kids = {
            "replica": start("replica", argv0="ray::ServeReplica:app:EngineDeployment",
                             stdout=subprocess.PIPE, text=True),
            "controller": start("leaf", argv0="ray::ServeController.listen_for_change"),
            "rank": start("leaf", argv0="ray::RankActor.execute"),
            "idle_worker": start("leaf", argv0="ray::IDLE"),
        }
        pids = {name: p.pid for name, p in kids.items()}
        pids["engine"] = int(kids["replica"].stdout.readline())
        print(json.dumps(pids), flush=True)
        sys.stdin.readline()  # after the demotion: a new worker
        later = start("leaf", argv0="ray::IDLE")
        print(later.pid, flush=True)
        sys.stdin.readline()
        for p in [*kids.values(), later]:
            p.kill()
        print("done", flush=True)
    elif role == "replica":
        engine = start("leaf", "-m", "pagedserve.cluster.engine_process")
        print(engine.pid, flush=True)
        time.sleep(120)
    else:
        time.sleep(120)
    """
)


def _policies(pid: int) -> set[int]:
    """The scheduling policy of every thread of `pid`."""
    return {os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{pid}/task")}


def _say(driver: subprocess.Popen) -> str:
    driver.stdin.write("\n")
    driver.stdin.flush()
    return driver.stdout.readline().strip()


def test_the_control_plane_goes_idle_and_the_request_path_keeps_its_policy(tmp_path: Path) -> None:
    script = tmp_path / "tree.py"
    script.write_text(TREE)
    env = {**os.environ, "TREE_PYTHON": sys.executable}
    driver = subprocess.Popen([sys.executable, str(script), "driver"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)  # fmt: skip
    try:
        pids = json.loads(driver.stdout.readline())
        assert _policies(driver.pid) == {os.SCHED_OTHER}

        demoted = idle_control_plane(driver.pid)

        assert sorted(demoted) == sorted([driver.pid, pids["daemon"], pids["controller"]])
        for pid in demoted:
            assert _policies(pid) == {os.SCHED_IDLE}
        for name in ("raylet", "replica", "engine", "rank", "idle_worker"):  # serves requests, or may
            assert _policies(pids[name]) == {os.SCHED_OTHER}, name
        # a worker the raylet starts afterwards (a replacement replica's) begins at SCHED_OTHER
        later = int(_say(driver))
        assert _policies(later) == {os.SCHED_OTHER}
        assert _say(driver) == "done"
        driver.stdin.close()
        assert driver.wait(timeout=30) == 0
    finally:  # the whole tree, also where an assertion left it running
        with contextlib.suppress(ProcessLookupError):
            os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()


@pytest.mark.parametrize(
    ("cmdline", "moves"),
    [  # command lines as /proc shows them for `pagedserve serve`'s processes (Ray 2.60)
        (["/v/lib/python3.11/site-packages/ray/core/src/ray/gcs/gcs_server", "--log_dir=/tmp/x"], True),
        (["/v/bin/python", "-u", "/v/site-packages/ray/_private/log_monitor.py", "--session-dir=/x"], True),
        (["/v/bin/python", "-u", "/v/ray/autoscaler/_private/monitor.py", "--logs-dir=/x"], True),
        (["/v/bin/python", "/v/site-packages/ray/dashboard/dashboard.py", "--host=127.0.0.1"], True),
        (["ray::DashboardAgent"], True),
        (["ray::ServeController.listen_for_change"], True),
        (["ray::NodeProbe"], True),
        (["/v/site-packages/ray/core/src/ray/raylet/raylet", "--raylet_socket_name=/tmp/x"], False),
        (["ray::ServeReplica:pagedserve:EngineDeployment"], False),
        (["ray::ReplicaStateActor"], False),
        (["ray::RankActor.execute"], False),
        (["ray::IDLE"], False),
        (["/v/bin/python", "-m", "pagedserve.cluster.engine_process", "57"], False),
        ([], False),
    ],
)
def test_only_the_named_control_plane_moves(cmdline: list[str], moves: bool) -> None:
    assert _is_control_plane(cmdline) is moves


def test_the_policy_flag_is_checked() -> None:
    from pagedserve.config import ConfigError, ServeConfig

    assert ServeConfig().control_plane_policy == "idle"
    with pytest.raises(ConfigError, match="control-plane-policy"):
        ServeConfig(control_plane_policy="realtime")
