"""A multi-node Ray cluster on one machine, made and watched by Ray's autoscaler as `ray up` would.

    python -m pagedserve.localcluster up --config deploy/local-cluster.yaml
    python -m pagedserve.localcluster status --config deploy/local-cluster.yaml
    python -m pagedserve.localcluster lose-node --config deploy/local-cluster.yaml [NODE_ID]
    python -m pagedserve.localcluster down --config deploy/local-cluster.yaml

``up`` starts the head (``ray start --head --block --autoscaling-config=...``) in a session of its
own. The head's autoscaler launches the worker nodes that the config's node types ask for
(``min_workers``), each a separate raylet with its own resources, through ``LocalNodeProvider``
(Ray's fake multi-node provider); when a worker node's raylet dies it stops hearing from it,
terminates it and launches a replacement, as it would replace a lost machine. ``lose-node``
SIGKILLs a worker node's raylet and every process under it at once, as a machine is lost (the
first worker unless a node id is given). ``down`` stops the head and then every process of its
session. Nothing else on the machine is touched: never ``ray stop``.

The config is an autoscaler config (``ray up``'s schema, which it passes) whose provider is
``pagedserve.localcluster.LocalNodeProvider``: ``provider.gcs_address`` holds the head's port; the
head node type's ``resources`` become ``ray start --num-cpus/--memory/--object-store-memory/
--resources``, so that no raylet claims a share of the whole machine.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider

HEAD_NODE_TYPE = "ray.head.default"  # the fake provider's name for the head's type
PROVIDER = "pagedserve.localcluster.LocalNodeProvider"
STATE_FILE = "cluster.json"
STOP_GRACE_S = 20.0


class LocalNodeProvider(FakeMultiNodeProvider):
    """Ray's fake multi-node provider, with worker nodes the autoscaler replaces when they die.

    Each node is a raylet (with its agents and workers) on this machine, started with the node
    type's CPU, memory, object store and custom resources, in the cluster's temp dir. Ray's own
    provider tags a node with the launcher's "uninitialized" status, so the autoscaler would
    never check its liveness; here a launched node is up to date at once (there is nothing to
    set up on this machine), and a node whose raylet stops reporting is terminated and replaced
    (``AUTOSCALER_HEARTBEAT_TIMEOUT_S`` after the GCS declares it dead).
    """

    def create_node_with_resources_and_labels(
        self, node_config: dict, tags: dict, count: int, resources: dict, labels: dict
    ) -> None:
        # All of them under the lock: an autoscaler update that saw part of a launch while the
        # launch still counted as pending would launch the rest again (and then remove the excess).
        with self.lock:
            for _ in range(count):
                self._create_node_with_resources_and_labels(node_config, tags, count, resources, labels)

    def _create_node_with_resources_and_labels(
        self, node_config: dict, tags: dict, count: int, resources: dict, labels: dict
    ) -> None:
        import ray
        import ray._private.ray_constants as ray_constants
        from ray.autoscaler.tags import (
            NODE_KIND_WORKER,
            STATUS_UP_TO_DATE,
            TAG_RAY_NODE_KIND,
            TAG_RAY_NODE_NAME,
            TAG_RAY_NODE_STATUS,
            TAG_RAY_USER_NODE_TYPE,
        )

        custom = copy.deepcopy(resources)
        store = custom.pop("object_store_memory", None)
        with self.lock:
            node_type = tags[TAG_RAY_USER_NODE_TYPE]
            node_id = self._next_hex_node_id()
            params = ray._private.parameter.RayParams(
                min_worker_port=0, max_worker_port=0, dashboard_port=None, dashboard_agent_listen_port=0,
                num_cpus=custom.pop("CPU", 0), num_gpus=custom.pop("GPU", 0),
                memory=custom.pop("memory", None), object_store_memory=store, resources=custom, labels=labels,
                gcs_address=self._gcs_address, redis_address=self._gcs_address,
                temp_dir=self.provider_config.get("temp_dir"),
                env_vars={
                    "RAY_OVERRIDE_NODE_ID_FOR_TESTING": node_id,  # the autoscaler knows nodes by id
                    "RAY_CLOUD_INSTANCE_ID": node_id,
                    "RAY_NODE_TYPE_NAME": node_type,
                    ray_constants.RESOURCES_ENVIRONMENT_VARIABLE: json.dumps(custom),
                    ray_constants.LABELS_ENVIRONMENT_VARIABLE: json.dumps(labels),
                },
            )  # fmt: skip
            node = ray._private.node.Node(params, head=False, shutdown_at_exit=False, spawn_reaper=False)
            self._nodes[node_id] = {
                "tags": {
                    TAG_RAY_NODE_KIND: NODE_KIND_WORKER, TAG_RAY_USER_NODE_TYPE: node_type,
                    TAG_RAY_NODE_NAME: node_id, **tags, TAG_RAY_NODE_STATUS: STATUS_UP_TO_DATE,
                },
                "node": node,
            }  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_config(path: str | Path) -> dict[str, Any]:
    config = yaml.safe_load(Path(path).read_text())
    provider = config.get("provider", {})
    if provider.get("type") != "external" or provider.get("module") != PROVIDER:
        raise ValueError(f"{path}: the provider must be {{type: external, module: {PROVIDER}}}")
    if config.get("head_node_type") != HEAD_NODE_TYPE:
        raise ValueError(f"{path}: head_node_type must be {HEAD_NODE_TYPE!r} (the fake provider's name)")
    return config


def default_temp_dir(config: dict[str, Any]) -> Path:
    # Short: Ray's Unix socket paths live under it and must stay within 107 bytes.
    return Path("/tmp") / f"ray-{config['cluster_name']}"


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name: state, ppid, pgrp, ... ([] when gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _processes() -> dict[int, list[str]]:
    return {int(e): stat for e in os.listdir("/proc") if e.isdigit() and (stat := _stat(int(e)))}


def _alive(pid: int) -> bool:
    return _stat(pid)[:1] not in ([], ["Z"])


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it."""
    kids: dict[int, list[int]] = {}
    for pid, stat in _processes().items():
        kids.setdefault(int(stat[1]), []).append(pid)
    todo, tree = [root], []
    while todo:
        tree.append(todo.pop())
        todo.extend(kids.get(tree[-1], []))
    return tree


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def _kill(pids: Iterable[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _auth_mode() -> str | None:
    """Ray 2.60 turns token auth on once ~/.ray/auth_token exists; a process joining the cluster by
    its address then needs RAY_AUTH_MODE=token too."""
    if "RAY_AUTH_MODE" in os.environ:
        return os.environ["RAY_AUTH_MODE"]
    return "token" if (Path.home() / ".ray" / "auth_token").exists() else None


@dataclass
class LocalCluster:
    """One head (its ``ray start --block`` process leads its own session) and its worker nodes."""

    config: dict[str, Any]
    temp_dir: Path
    head_pid: int
    port: int
    dashboard_port: int
    auth_mode: str | None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def min_workers(self) -> int:
        types = self.config["available_node_types"]
        return sum(t.get("min_workers", 0) for name, t in types.items() if name != HEAD_NODE_TYPE)

    def processes(self) -> list[int]:
        """The live processes of this cluster: its head's process group, once one of them shows
        this cluster's temp dir on its command line (a pid, and so a group id, is reused only
        after the whole group is gone)."""
        procs = _processes().items()
        members = [pid for pid, stat in procs if int(stat[2]) == self.head_pid and stat[0] != "Z"]
        ours = any(f"--temp_dir={self.temp_dir}" in args or f"--temp-dir={self.temp_dir}" in args
                   for args in map(_cmdline, members))  # fmt: skip
        return members if ours else []

    def raylets(self) -> dict[str, int]:
        """Node id -> raylet pid of this cluster's live raylets (the head's included)."""
        out = {}
        for pid in self.processes():
            args = _cmdline(pid)
            if args and args[0].endswith("/raylet"):
                node_id = next(a.split("=", 1)[1] for a in args if a.startswith("--node_id="))
                out[node_id] = pid
        return out

    def worker_raylets(self) -> dict[str, int]:
        from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID

        return {node_id: pid for node_id, pid in self.raylets().items() if node_id != FAKE_HEAD_NODE_ID}

    def wait_for_workers(self, count: int | None = None, timeout: float = 120.0,
                         exclude: Iterable[str] = ()) -> dict[str, int]:  # fmt: skip
        """Wait until ``count`` (default: min_workers) worker raylets run, not counting ``exclude``."""
        count = self.min_workers() if count is None else count
        exclude = set(exclude)
        deadline = time.monotonic() + timeout
        while True:
            if not _alive(self.head_pid):
                raise RuntimeError(f"the head exited; see {self.temp_dir / 'head.log'}")
            workers = {n: p for n, p in self.worker_raylets().items() if n not in exclude}
            if len(workers) >= count:
                return workers
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(workers)} of {count} worker nodes after {timeout:.0f} s")
            time.sleep(0.5)

    def kill_node(self, node_id: str) -> list[int]:
        """Lose a worker node as a machine is lost: SIGKILL its raylet and everything under it (its
        workers, the actors they hold, its agents) at once, with no drain. Returns the pids."""
        pid = self.worker_raylets()[node_id]
        tree = process_tree(pid)
        _kill(tree)
        return tree

    def stop(self, keep_logs: Path | None = None) -> None:
        """SIGTERM the head (it drains and stops its own processes), then SIGKILL what is left of its
        session: the worker nodes (the autoscaler's children) and any process they started. The
        temp dir goes too; its session's logs are copied to ``keep_logs`` first, if given."""
        if self.head_pid in self.processes():
            _kill([self.head_pid], signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            while _alive(self.head_pid) and time.monotonic() < deadline:
                time.sleep(0.2)
        for _ in range(50):
            members = self.processes()
            if not members:
                break
            _kill(members)
            time.sleep(0.2)
        try:  # reap our child, when this process started it
            os.waitpid(self.head_pid, os.WNOHANG)
        except ChildProcessError:
            pass
        logs = self.temp_dir / "session_latest" / "logs"
        if keep_logs is not None and logs.is_dir():
            shutil.copytree(logs, keep_logs, dirs_exist_ok=True)
            shutil.copy(self.temp_dir / "head.log", keep_logs)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def save(self) -> None:
        state = {"head_pid": self.head_pid, "port": self.port, "dashboard_port": self.dashboard_port,
                 "auth_mode": self.auth_mode}  # fmt: skip
        (self.temp_dir / STATE_FILE).write_text(json.dumps(state))

    @classmethod
    def load(cls, config: dict[str, Any], temp_dir: Path) -> LocalCluster:
        state = json.loads((temp_dir / STATE_FILE).read_text())
        return cls(config=config, temp_dir=temp_dir, **state)


def start(config_path: str | Path, *, temp_dir: str | Path | None = None, port: int | None = None,
          dashboard_port: int | None = None, client_port: int | None = None,
          auth_mode: str | None = None) -> LocalCluster:  # fmt: skip
    """Start the head of the config's cluster; its autoscaler then launches the worker nodes.

    Ports left out come from the config (``provider.gcs_address``, ``provider.dashboard_port``,
    ``provider.ray_client_server_port``). ``auth_mode`` is the cluster's RAY_AUTH_MODE (default:
    $RAY_AUTH_MODE, else "token" where ~/.ray/auth_token exists, as Ray decides); a process joining
    needs the same in its environment before it imports ray. Returns at once: ``wait_for_workers``
    waits for the nodes.
    """
    config = load_config(config_path)
    provider = config["provider"]
    temp_dir = Path(temp_dir) if temp_dir else default_temp_dir(config)
    if (temp_dir / STATE_FILE).exists() and _alive(LocalCluster.load(config, temp_dir).head_pid):
        raise RuntimeError(f"a cluster already runs from {temp_dir}; stop it first (down)")
    shutil.rmtree(temp_dir, ignore_errors=True)
    temp_dir.mkdir(parents=True)
    port = port or int(provider["gcs_address"].rsplit(":", 1)[1])
    dashboard_port = dashboard_port or int(provider.get("dashboard_port", 8265))
    client_port = client_port or int(provider.get("ray_client_server_port", 10001))
    provider.update(gcs_address=f"127.0.0.1:{port}", temp_dir=str(temp_dir))
    bootstrap = temp_dir / "autoscaler.yaml"
    bootstrap.write_text(yaml.safe_dump(config))

    head = dict(config["available_node_types"][HEAD_NODE_TYPE].get("resources", {}))
    command = [
        sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--disable-usage-stats",
        f"--port={port}", f"--temp-dir={temp_dir}", f"--autoscaling-config={bootstrap}",
        f"--dashboard-port={dashboard_port}", "--dashboard-agent-listen-port=0",
        f"--ray-client-server-port={client_port}", f"--num-cpus={head.pop('CPU', 1)}",
        f"--num-gpus={head.pop('GPU', 0)}",
    ]  # fmt: skip
    for key in ("memory", "object_store_memory"):
        if key in head:
            command.append(f"--{key.replace('_', '-')}={int(head.pop(key))}")
    if head:
        command.append(f"--resources={json.dumps(head)}")
    env = dict(os.environ, RAY_FAKE_CLUSTER="1", OMP_WAIT_POLICY="PASSIVE",
               AUTOSCALER_UPDATE_INTERVAL_S=str(provider.get("autoscaler_update_interval_s", 1)),
               AUTOSCALER_HEARTBEAT_TIMEOUT_S=str(provider.get("heartbeat_timeout_s", 5)))  # fmt: skip
    env.pop("RAY_ADDRESS", None)
    auth_mode = auth_mode or _auth_mode()
    if auth_mode:
        env["RAY_AUTH_MODE"] = auth_mode
    with open(temp_dir / "head.log", "wb") as log:
        proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    cluster = LocalCluster(config=config, temp_dir=temp_dir, head_pid=proc.pid, port=port,
                           dashboard_port=dashboard_port, auth_mode=auth_mode)  # fmt: skip
    cluster.save()
    return cluster


def wait_for_alive_nodes(count: int, timeout: float = 120.0) -> list[dict[str, Any]]:
    """From a connected driver: wait until ``count`` nodes are alive in the GCS; returns them."""
    import ray

    deadline = time.monotonic() + timeout
    while True:
        alive = [n for n in ray.nodes() if n["Alive"]]
        if len(alive) >= count:
            return alive
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(alive)} of {count} nodes alive after {timeout:.0f} s")
        time.sleep(0.5)


# Run in a fresh process: Ray reads RAY_AUTH_MODE when it is imported, and this module imports it.
_LIST_NODES = """
import json, sys, ray
from pagedserve.localcluster import wait_for_alive_nodes
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
nodes = wait_for_alive_nodes(int(sys.argv[2]), float(sys.argv[3]))
print(json.dumps([{"id": n["NodeID"], "resources": n["Resources"]} for n in nodes]))
"""


def _up(args: argparse.Namespace, config: dict[str, Any], temp_dir: Path) -> int:
    cluster = start(args.config, temp_dir=temp_dir, port=args.port, dashboard_port=args.dashboard_port)
    env = dict(os.environ, **({"RAY_AUTH_MODE": cluster.auth_mode} if cluster.auth_mode else {}))
    try:
        cluster.wait_for_workers(timeout=args.timeout)
        check = [sys.executable, "-c", _LIST_NODES, cluster.address, str(1 + cluster.min_workers()),
                 str(args.timeout)]  # fmt: skip
        listed = subprocess.run(check, env=env, capture_output=True, text=True, timeout=args.timeout + 60)
        if listed.returncode != 0:
            raise RuntimeError(f"the nodes did not come up:\n{listed.stderr[-2000:]}")
        nodes = json.loads(listed.stdout.strip().splitlines()[-1])
    except BaseException:
        cluster.stop()
        raise
    auth = f"RAY_AUTH_MODE={cluster.auth_mode} " if cluster.auth_mode else ""
    print(f"local cluster {config['cluster_name']!r} up: {len(nodes)} nodes, head pid {cluster.head_pid}")
    for n in nodes:
        custom = {k: v for k, v in n["resources"].items() if not k.startswith("node:")}
        print(f"  {n['id']}  {custom}")
    print(f"address {cluster.address}   dashboard {cluster.dashboard_url}")
    print(f"logs    {temp_dir}/session_latest/logs")
    print(f"serve:  {auth}pagedserve serve --address {cluster.address} --num-replicas 2 "
          "--replica-resources '{\"pagedserve_engine\": 1}'")  # fmt: skip
    print(f"stop:   python -m pagedserve.localcluster down --config {args.config}")
    return 0


def _status(cluster: LocalCluster) -> int:
    alive = _alive(cluster.head_pid)
    print(f"head pid {cluster.head_pid} {'running' if alive else 'gone'}; address {cluster.address}")
    for node_id, pid in sorted(cluster.raylets().items()):
        print(f"  raylet {node_id} pid {pid}")
    return 0 if alive else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedserve.localcluster",
                                     description=__doc__.split("\n")[0])  # fmt: skip
    parser.add_argument("command", choices=("up", "down", "status", "lose-node"))
    parser.add_argument("node_id", nargs="?", default=None, help="lose-node: the worker node to lose")
    parser.add_argument("--config", default="deploy/local-cluster.yaml")
    parser.add_argument("--temp-dir", default=None, help="default: /tmp/ray-<cluster_name>")
    parser.add_argument("--port", type=int, default=None, help="the head's GCS port (default: the config's)")
    parser.add_argument("--dashboard-port", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for the nodes")
    args = parser.parse_args(argv)
    config = load_config(args.config)
    temp_dir = Path(args.temp_dir) if args.temp_dir else default_temp_dir(config)
    if args.command == "up":
        return _up(args, config, temp_dir)
    if not (temp_dir / STATE_FILE).exists():
        print(f"no local cluster runs from {temp_dir}", file=sys.stderr)
        return 1
    cluster = LocalCluster.load(config, temp_dir)
    if args.command == "status":
        return _status(cluster)
    if args.command == "lose-node":
        node_id = args.node_id or min(cluster.worker_raylets(), default=None)
        if node_id not in cluster.worker_raylets():
            print(f"no live worker node {node_id}", file=sys.stderr)
            return 1
        killed = cluster.kill_node(node_id)
        print(f"lost worker node {node_id}: SIGKILLed its raylet and the {len(killed) - 1} processes "
              "under it")  # fmt: skip
        return 0
    cluster.stop()
    print(f"local cluster {config['cluster_name']!r} stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
