"""How one step's plan reaches every rank of a group, and the ranks' outputs come back.

Each transport takes the plan's msgpack bytes once and returns every rank's output bytes, in
rank order; a rank that died, raised, or did not answer within the timeout raises. Three kinds
(``--plan-transport``), compared by ``benchmarks/tp_step.py``:

- ``socket`` (default): one connected socket per rank (``worker/plan_channel.py``); blocking
  reads, a few tens of microseconds per step, no CPU while waiting.
- ``compiled_graph``: a Ray Compiled Graph over the ranks' ``execute_wire`` (shared-memory
  channels set up once); its readers spin while they wait, which costs whole cores on a CPU host.
- ``actor_call``: one plain Ray actor call per rank per step (the baseline).
"""

from __future__ import annotations

import logging

import ray

from pagedserve.worker.plan_channel import ERROR, PlanListener, recv_frame, send_frame

logger = logging.getLogger(__name__)


class RankError(RuntimeError):
    """A rank raised while executing a step (its message names the rank)."""


class ActorCallTransport:
    def __init__(self, ranks: list, timeout_s: float) -> None:
        self.ranks, self.timeout_s = ranks, timeout_s

    def run(self, wire: bytes) -> list[bytes]:
        return ray.get([r.execute_wire.remote(wire) for r in self.ranks], timeout=self.timeout_s)

    def close(self) -> None:
        pass


class CompiledGraphTransport:
    def __init__(self, ranks: list, timeout_s: float) -> None:
        from ray.dag import InputNode, MultiOutputNode

        self.timeout_s = timeout_s
        with InputNode() as plan:
            dag = MultiOutputNode([r.execute_wire.bind(plan) for r in ranks])
        self.dag = dag.experimental_compile(_submit_timeout=timeout_s)

    def run(self, wire: bytes) -> list[bytes]:
        outputs = ray.get(self.dag.execute(wire), timeout=self.timeout_s)
        for out in outputs:
            if isinstance(out, Exception):  # a rank's exception comes back as its output
                raise out
        return outputs

    def close(self) -> None:
        # Called after the ranks were killed: the graph logs each failed cancel as an error.
        dag_logger = logging.getLogger("ray.dag.compiled_dag_node")
        level = dag_logger.level
        dag_logger.setLevel(logging.CRITICAL)
        try:
            self.dag.teardown()
        except Exception:  # a graph whose actors died may already be torn down
            logger.debug("compiled graph teardown", exc_info=True)
        finally:
            dag_logger.setLevel(level)


class SocketTransport:
    def __init__(self, ranks: list, timeout_s: float, host: str | None) -> None:
        """host None: every rank shares this node (Unix sockets); else this node's address (TCP)."""
        self.listener = PlanListener(host)
        try:
            ray.get([r.serve_plans.remote(self.listener.address, self.listener.token) for r in ranks],
                    timeout=timeout_s)  # fmt: skip
            self.conns = self.listener.accept(len(ranks))
        except BaseException:
            self.listener.close()
            raise
        self.timeout_s = timeout_s
        for conn in self.conns:
            conn.settimeout(timeout_s)

    def run(self, wire: bytes) -> list[bytes]:
        rank = 0  # the rank being talked to, for the error message
        try:
            for i, conn in enumerate(self.conns):
                rank = i
                send_frame(conn, wire)
            outputs = []
            for i, conn in enumerate(self.conns):
                rank = i
                kind, payload = recv_frame(conn)
                if kind == ERROR:
                    raise RankError(payload.decode(errors="replace"))
                outputs.append(payload)
        except TimeoutError:
            raise TimeoutError(f"rank {rank} did not answer within {self.timeout_s:g} s") from None
        except OSError as exc:  # ChannelClosed, a reset connection: the rank's process is gone
            raise ConnectionError(f"rank {rank} is gone ({exc})") from None
        return outputs

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
        self.listener.close()


def make_transport(kind: str, ranks: list, timeout_s: float, local: bool):
    """local: every rank runs on this process's node (the socket transport then uses Unix sockets)."""
    if kind == "socket":
        return SocketTransport(ranks, timeout_s, None if local else ray.util.get_node_ip_address())
    if kind == "compiled_graph":
        return CompiledGraphTransport(ranks, timeout_s)
    return ActorCallTransport(ranks, timeout_s)
