"""The served app on a multi-node cluster on this machine (deploy/local-cluster.yaml: a head and two
worker nodes, each its own raylet, made and watched by Ray's autoscaler through
pagedserve.localcluster), and the loss of a worker node.

The two engine replicas reserve the `pagedserve_engine` resource that only the worker nodes have
(``--replica-resources``), so they land one on each. Both serve; then one worker node is lost the
way a machine is lost: its raylet and every process under it (the engine replica among them) are
SIGKILLed at once, with no drain (a SIGTERM would let Ray drain the node and Serve move the replica
first, which is a planned removal, not a failure). Requests in flight there end with a clear error
or are sent again; none hangs; new requests go to the other replica; the admin API shows the node
dead; the autoscaler replaces the node, Serve starts the replica there, and the router uses it.
The node lost is the busier one; the ingress and the cluster state actor are on the head. The
test prints the failover time (loss -> every new request served), when each reaction came, and the
recovery time (replacement node started -> its replica serving).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2
import pytest

from pagedserve import localcluster
from tests.clients import Stream, wait_until

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "local-cluster.yaml"
ADMIN_TOKEN = "multinode-admin-token"
REQUEST_TIMEOUT_S = 60.0  # every request's deadline: nothing may hang
STREAMS = 6  # in flight when the node is lost, on both replicas (max_num_seqs 4 each)
STREAM_TOKENS = 200
PROBE_WINDOW_S = 25.0  # new requests sent for this long after the kill


def complete(http: httpx2.Client, prompt: str, max_tokens: int = 4) -> httpx2.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return http.post("/v1/completions", json=body)


def error_code(r: httpx2.Response) -> str:
    try:
        return str(r.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):  # not our error shape
        return r.text[:80]


def admin(http: httpx2.Client, what: str) -> list[dict]:
    r = http.get(f"/admin/api/{what}", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert r.status_code == 200, r.text
    return r.json()


def replicas_by_node(http: httpx2.Client) -> dict[str, dict]:
    return {r["node_id"]: r for r in admin(http, "replicas") if r.get("node_id")}


def burst(http: httpx2.Client, tag: str, n: int = 8, max_tokens: int = 4) -> list[int]:
    """``n`` concurrent completions with distinct prompts; their status codes."""
    with ThreadPoolExecutor(n) as pool:
        replies = pool.map(lambda i: complete(http, f"{tag} {i}: the weather in city {i} is", max_tokens),
                           range(n))  # fmt: skip
        return [r.status_code for r in replies]


def test_local_cluster_config_passes_ray_up_validation() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = localcluster.load_config(CONFIG)
    validate_config(prepare_config(config))
    types = config["available_node_types"]
    workers = [t for name, t in types.items() if name != localcluster.HEAD_NODE_TYPE]
    assert sum(t["min_workers"] for t in workers) == 2
    assert all(t["resources"].get("pagedserve_engine") == 1 for t in workers)
    for t in types.values():  # no raylet may claim a share of the whole machine
        assert {"CPU", "memory", "object_store_memory"} <= set(t["resources"]), t


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_two_nodes_serve_one_is_lost_and_replaced(smollm2_dir: Path, tmp_path: Path) -> None:
    import ray
    from ray import serve

    from pagedserve.config import EngineConfig, ServeConfig
    from pagedserve.router.app import deploy

    if ray.is_initialized():  # a session fixture's private Ray: one process drives one cluster
        pytest.skip("this process already drives a Ray cluster; run the multi-node test first or alone")
    temp_dir = tempfile.mkdtemp(prefix="psmn-", dir="/tmp")  # short: Ray's socket paths live under it
    # This process read its RAY_AUTH_MODE when it imported ray; the cluster takes the same mode.
    cluster = localcluster.start(
        CONFIG, temp_dir=temp_dir, port=localcluster.free_port(), dashboard_port=localcluster.free_port(),
        client_port=localcluster.free_port(), auth_mode=os.environ.get("RAY_AUTH_MODE", "disabled"),
    )  # fmt: skip
    engine = EngineConfig.from_flags(max_model_len=512, kv_cache_memory=64 << 20, max_num_seqs=4,
                                     dtype="float32")  # fmt: skip
    # One proxy, on the head (--proxy-location HeadOnly): every node is this machine, and proxies
    # on the workers would all want the same port. The ingress and the cluster state actor live
    # on the head too (build_app, state.py): losing a worker loses engine replicas only.
    config = ServeConfig(port=localcluster.free_port(), num_replicas=2, admin_token=ADMIN_TOKEN,
                         replica_resources={"pagedserve_engine": 1}, proxy_location="HeadOnly",
                         engine=engine)  # fmt: skip
    base_url = f"http://127.0.0.1:{config.port}"
    try:
        workers = cluster.wait_for_workers(timeout=120)
        ray.init(address=cluster.address, log_to_driver=False)
        localcluster.wait_for_alive_nodes(1 + len(workers), timeout=60)
        started = time.monotonic()
        deploy(config)
        print(f"\ncluster up, app deployed in {time.monotonic() - started:.1f} s")
        with httpx2.Client(base_url=base_url, timeout=REQUEST_TIMEOUT_S) as http:
            _serve_lose_and_recover(cluster, http, base_url)
    finally:
        if ray.is_initialized():
            try:
                serve.shutdown()
            finally:
                ray.shutdown()
        cluster.stop(keep_logs=tmp_path / "ray-logs")  # the cluster's logs, for a failure's story
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert not cluster.raylets(), "processes of the local cluster outlived it"


class Timeline(threading.Thread):
    """Seconds from the node loss to each thing the cluster does about it, watched every 0.2 s."""

    def __init__(self, cluster: localcluster.LocalCluster, base_url: str, lost: str, survivor: str) -> None:
        super().__init__(daemon=True)
        self.cluster, self.base_url, self.lost, self.survivor = cluster, base_url, lost, survivor
        self.start_time = time.monotonic()
        self.at: dict[str, float] = {}
        self.new_node: str | None = None
        self.stopped = threading.Event()

    def mark(self, event: str) -> None:
        self.at.setdefault(event, time.monotonic() - self.start_time)

    def run(self) -> None:
        import ray

        with httpx2.Client(base_url=self.base_url, timeout=5) as http:
            while not self.stopped.wait(0.2):
                new = set(self.cluster.worker_raylets()) - {self.lost, self.survivor}
                if new:
                    self.new_node = min(new)
                    self.mark("replacement raylet started")
                if any(n["NodeID"] == self.lost and not n["Alive"] for n in ray.nodes()):
                    self.mark("GCS declares the node dead")
                try:
                    nodes = {n["node_id"]: n["alive"] for n in admin(http, "nodes")}
                    replicas = replicas_by_node(http)
                except (httpx2.HTTPError, AssertionError):
                    continue  # an answer later
                if nodes.get(self.lost) is False:
                    self.mark("admin API lists the node dead")
                if self.lost not in replicas:
                    self.mark("lost replica gone from the admin API")
                if self.new_node in replicas:
                    self.mark("replica started on the replacement")

    def __str__(self) -> str:
        return "; ".join(f"{event} {t:.1f} s" for event, t in sorted(self.at.items(), key=lambda e: e[1]))


def _serve_lose_and_recover(cluster: localcluster.LocalCluster, http: httpx2.Client, base_url: str) -> None:
    from ray.util.state import list_actors

    # ---- the replicas are on the two worker nodes, one each, and both serve
    on_nodes = wait_until(lambda: len(found := replicas_by_node(http)) == 2 and found, "two replicas", 120,
                          period=0.5)
    workers = cluster.worker_raylets()
    assert set(on_nodes) == set(workers), (on_nodes.keys(), workers)
    actors = list_actors(address=cluster.dashboard_url, filters=[("state", "=", "ALIVE")], limit=1000)
    print("placement: " + ", ".join(sorted(f"{a.class_name.split(':')[-1]} ...{a.node_id[-5:]}"
                                           for a in actors)))  # fmt: skip
    # the front door and the routers' view live on the head: a worker's loss costs replicas only
    kept = ("ReplicaStateActor", "ServeReplica:pagedserve:OpenAIIngress")
    head_side = {a.class_name: a.node_id for a in actors if a.class_name in kept}
    assert len(head_side) == 2 and not set(head_side.values()) & set(workers), head_side

    def both_served() -> bool:
        assert burst(http, "warm-up") == [200] * 8
        return all(r["generation_tokens"] > 0 for r in replicas_by_node(http).values())

    wait_until(both_served, "both replicas serving", 120, period=0)

    # ---- streams on both replicas; then a node is lost: the busier one
    streams = [Stream(f"Node loss {i}: a long story about the number {i} begins") for i in range(STREAMS)]
    for s in streams:
        threading.Thread(target=s.run, args=(base_url, STREAM_TOKENS), kwargs={"timeout": REQUEST_TIMEOUT_S},
                         daemon=True).start()  # fmt: skip

    def victim() -> str | None:
        # Each replica publishes its counts a step late; once they add up to every stream, each is
        # exact. The busier replica's node is lost, so the survivor holds at most 3 of the 6 and
        # has a free sequence slot for new requests (were it the one running 4 = max_num_seqs,
        # they would queue behind its 200-token streams: the failover would measure that).
        by_node = replicas_by_node(http)
        held = {node: r["num_running"] + r["num_waiting"] for node, r in by_node.items()}
        if sum(held.values()) != STREAMS or min(r["num_running"] for r in by_node.values()) < 1:
            return None
        if sum(s.tokens > 0 for s in streams) < 4:
            return None
        return max(held, key=held.get)

    lost_node = wait_until(victim, "streams running on both replicas", 120, period=0.1)
    survivor_node = next(n for n in on_nodes if n != lost_node)
    time.sleep(1.0)  # its streams have tokens by now
    had_tokens = [s.tokens > 0 for s in streams]
    killed = cluster.kill_node(lost_node)
    timeline = Timeline(cluster, base_url, lost_node, survivor_node)
    killed_at = timeline.start_time
    timeline.start()
    print(f"lost node ...{lost_node[-5:]}: SIGKILLed its raylet and the {len(killed) - 1} processes "
          "under it")  # fmt: skip

    # ---- new requests from the moment of the loss: from when is every one of them served?
    probes: list[tuple[float, float, int, str]] = []  # sent, ended (s after the kill), status, error code

    def probe_forever(worker: int) -> None:
        i = 0
        while time.monotonic() - killed_at < PROBE_WINDOW_S:
            sent = time.monotonic() - killed_at
            try:
                r = complete(http, f"probe {worker}.{i}: after the loss, the answer is")
                status, code = r.status_code, "" if r.status_code == 200 else error_code(r)
            except httpx2.HTTPError as exc:
                status, code = 0, type(exc).__name__
            probes.append((sent, time.monotonic() - killed_at, status, code))
            i += 1

    probers = [threading.Thread(target=probe_forever, args=(w,), daemon=True) for w in range(2)]
    for t in probers:
        t.start()

    # ---- every stream ends, with its tokens or a clear error, well before its deadline
    for s in streams:
        assert s.done.wait(REQUEST_TIMEOUT_S + 30), f"stream {s.prompt!r} hangs"
    for t in probers:
        t.join(PROBE_WINDOW_S + REQUEST_TIMEOUT_S + 10)
        assert not t.is_alive(), "a probe request hangs"
    print("in-flight streams (s after the loss): " + "; ".join(
        f"completed at {s.ended_at - killed_at:.1f}" if s.error is None else
        f"{s.error['code']} after {s.tokens} chunks at {s.ended_at - killed_at:.1f}" for s in streams
    ))  # fmt: skip
    for s, had in zip(streams, had_tokens):
        if s.error is None:
            assert s.status == 200 and s.finish_reason == "length" and s.usage_tokens == STREAM_TOKENS, s
        else:  # it was running on the lost node: the output it had streamed is all it gets
            assert had and s.error["code"] == "engine_lost" and "send it again" in s.error["message"], s
    assert any(s.error is not None for s in streams), "no stream ran on the lost node"

    probes.sort()
    failed = [p for p in probes if p[2] != 200]
    failover_s = max((p[0] for p in failed), default=0.0)  # every probe sent after it was served
    slowest = max(probes, key=lambda p: p[1] - p[0])
    print(f"new requests after the loss: {len(probes)} sent, {len(failed)} failed "
          f"{[f'{p[2]} {p[3]} sent at {p[0]:.1f} s' for p in failed]}; the slowest took "
          f"{slowest[1] - slowest[0]:.1f} s (sent at {slowest[0]:.1f} s)")  # fmt: skip
    assert len([p for p in probes if p[0] > failover_s]) >= 10 and failover_s < PROBE_WINDOW_S - 5, probes
    assert all(p[2] in (200, 503) for p in probes), failed  # the clear error a client retries on
    assert burst(http, "survivor") == [200] * 8

    # ---- the admin API lists the node dead; the autoscaler replaces it, Serve starts the replica
    # there and the router sends it requests
    wait_until(lambda: "admin API lists the node dead" in timeline.at, "the lost node listed dead", 90, 0.5)
    wait_until(lambda: timeline.new_node, "a replacement node", 120, 0.5)

    def new_replica_serves() -> bool:
        burst(http, "recovery")
        replica = replicas_by_node(http).get(timeline.new_node)
        return replica is not None and replica["generation_tokens"] > 0

    wait_until(new_replica_serves, "the replacement replica serving", 180, period=0)
    timeline.mark("replacement replica serving")
    timeline.stopped.set()
    timeline.join(10)
    assert set(replicas_by_node(http)) == {survivor_node, timeline.new_node}
    assert burst(http, "recovered") == [200] * 8
    nodes = {n["node_id"]: n["alive"] for n in admin(http, "nodes")}
    assert nodes[timeline.new_node] and nodes[survivor_node] and not nodes[lost_node], nodes
    print(f"after the loss: {timeline}")
    recovery_s = timeline.at["replacement replica serving"] - timeline.at["replacement raylet started"]
    print(f"node loss: failover {failover_s:.1f} s (loss -> every new request served); recovery "
          f"{recovery_s:.1f} s (replacement node started -> its replica serving), "
          f"{timeline.at['replacement replica serving']:.1f} s from the loss")  # fmt: skip
