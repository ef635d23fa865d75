"""The plan channel between a scheduler and its ranks, with threads standing in for rank actors."""

from __future__ import annotations

import socket
import threading

import msgpack
import pytest

from pagedserve.worker.plan_channel import (
    ERROR,
    OK,
    ChannelClosed,
    PlanListener,
    recv_frame,
    send_frame,
    serve_plans,
)


@pytest.fixture(params=["unix", "tcp"])
def listener(request):
    lst = PlanListener(None if request.param == "unix" else "127.0.0.1")
    yield lst
    lst.close()


def echo_rank(rank: int):
    def execute(plan: bytes) -> bytes:
        step = msgpack.unpackb(plan)
        if step == "boom":
            raise ValueError("bad plan")
        return msgpack.packb([rank, step])

    return execute


def test_every_rank_gets_the_same_plan_and_answers_in_rank_order(listener):
    threads = [serve_plans(listener.address, listener.token, r, echo_rank(r)) for r in (2, 0, 1)]
    conns = listener.accept(3, timeout_s=10)
    big = list(range(200_000))  # ~600 KB: frames larger than a socket buffer arrive whole
    for step in (1, "x", big):
        for conn in conns:
            send_frame(conn, msgpack.packb(step))
        assert [msgpack.unpackb(recv_frame(c)[1]) for c in conns] == [[0, step], [1, step], [2, step]]
    # an exception in a rank comes back as an ERROR frame naming the rank; the rank stays up
    send_frame(conns[1], msgpack.packb("boom"))
    kind, payload = recv_frame(conns[1])
    assert kind == ERROR and payload.decode() == "rank 1: ValueError: bad plan"
    send_frame(conns[1], msgpack.packb(5))
    assert recv_frame(conns[1]) == (OK, msgpack.packb([1, 5]))
    # the scheduler closing its side ends each rank's loop
    for conn in conns:
        conn.close()
    for t in threads:
        t.join(timeout=5)
        assert not t.is_alive()


def test_a_wrong_token_or_a_duplicate_rank_is_refused(listener):
    serve_plans(listener.address, "not-the-token", 0, echo_rank(0))
    serve_plans(listener.address, listener.token, 0, echo_rank(0))
    serve_plans(listener.address, listener.token, 0, echo_rank(9))  # the same rank again
    serve_plans(listener.address, listener.token, 1, echo_rank(1))
    conns = listener.accept(2, timeout_s=10)
    for conn in conns:
        send_frame(conn, msgpack.packb(7))
    assert [msgpack.unpackb(recv_frame(c)[1]) for c in conns] == [[0, 7], [1, 7]]


def test_a_closed_peer_is_channel_closed_and_silence_times_out():
    a, b = socket.socketpair()
    b.settimeout(0.2)
    with pytest.raises(TimeoutError):
        recv_frame(b)
    send_frame(a, b"partial")
    a.shutdown(socket.SHUT_WR)
    assert recv_frame(b) == (OK, b"partial")
    with pytest.raises(ChannelClosed):
        recv_frame(b)
    a.close()
    b.close()


def test_the_unix_socket_lives_in_a_private_directory():
    import os
    import stat

    lst = PlanListener(None)
    try:
        folder = os.path.dirname(lst.address[1])
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    finally:
        lst.close()
    assert not os.path.exists(folder)


def test_concurrent_ranks_do_not_interleave_frames(listener):
    # each rank answers from its own thread while the scheduler reads them in order
    done = threading.Event()
    serve_plans(listener.address, listener.token, 0, lambda p: (done.wait(1), p * 3)[1])
    serve_plans(listener.address, listener.token, 1, lambda p: p * 5)
    conns = listener.accept(2, timeout_s=10)
    for conn in conns:
        send_frame(conn, b"ab")
    done.set()
    assert [recv_frame(c)[1] for c in conns] == [b"ababab", b"ababababab"]
