"""The Ray Serve internals pagedserve depends on, checked by name and signature.

pyproject.toml pins Ray to the minor version these tests pass on; an upgrade that moves one of
these breaks here, with a message naming the internal and the file that uses it, not silently in
a served cluster (a router whose hook is never called routes nothing by prefix).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from contextvars import ContextVar

import pytest
import ray

# (module, attribute, where pagedserve uses it)
INTERNALS = [
    ("ray.serve._private.constants", "SERVE_CONTROLLER_NAME", "pagedserve/router/state.py"),
    ("ray.serve._private.constants", "SERVE_NAMESPACE", "pagedserve/router/state.py"),
    ("ray.serve.context", "_get_serve_request_context", "pagedserve/router/app.py"),
    ("ray.serve.context", "_serve_request_context", "pagedserve/router/app.py"),
    ("ray.serve.request_router", "RequestRouter", "pagedserve/router/prefix_router.py"),
    ("ray.serve.request_router", "PendingRequest", "pagedserve/router/prefix_router.py"),
    ("ray.serve.request_router", "RunningReplica", "pagedserve/router/prefix_router.py"),
    ("ray.serve.request_router", "ReplicaID", "pagedserve/router/prefix_router.py"),
    ("ray.serve._private.common", "RequestMetadata", "benchmarks/routing.py"),
    ("ray.serve._private.request_router.pow_2_router", "PowerOfTwoChoicesRequestRouter",
     "pagedserve/router/prefix_router.py, benchmarks/routing.py"),
]

# RequestRouter hooks our routers override or call: name -> the parameters Serve passes
ROUTER_HOOKS = {
    "on_send_request": ["self", "replica_id"],
    "on_request_routed": ["self", "pending_request", "replica_id", "result"],
    "on_request_completed": ["self", "replica_id", "internal_request_id"],
    "update_replicas": ["self", "replicas"],
    "choose_replicas": ["self", "candidate_replicas", "pending_request"],
    "initialize_state": ["self", "kwargs"],
    "_select_from_candidate_replicas": ["self", "candidates", "backoff_index"],  # benchmarks/routing.py
}


def moved(what: str, where: str, detail: str) -> str:
    return (f"Ray {ray.__version__}: {what} moved or changed ({detail}); {where} depends on it. "
            "Adapt it before raising the Ray pin in pyproject.toml.")  # fmt: skip


@pytest.mark.parametrize(("module", "name", "where"), INTERNALS, ids=[f"{m}.{n}" for m, n, _ in INTERNALS])
def test_internal_exists(module: str, name: str, where: str) -> None:
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        pytest.fail(moved(module, where, f"import failed: {exc}"))
    assert hasattr(mod, name), moved(f"{module}.{name}", where, "no such attribute")


@pytest.mark.parametrize("hook", sorted(ROUTER_HOOKS))
def test_request_router_hooks_keep_their_signatures(hook: str) -> None:
    from ray.serve.request_router import RequestRouter

    where = "pagedserve/router/prefix_router.py"
    assert hasattr(RequestRouter, hook), moved(f"RequestRouter.{hook}", where, "no such method")
    params = list(inspect.signature(getattr(RequestRouter, hook)).parameters)
    assert params == ROUTER_HOOKS[hook], moved(f"RequestRouter.{hook}", where, f"parameters now {params}")


def test_fields_and_attributes_we_read() -> None:
    from ray.serve._private.common import RequestMetadata
    from ray.serve.context import _get_serve_request_context, _serve_request_context
    from ray.serve.request_router import RequestRouter, RunningReplica

    assert isinstance(_serve_request_context, ContextVar), moved(
        "ray.serve.context._serve_request_context", "pagedserve/router/app.py", "no longer a ContextVar"
    )
    fields = {f.name for f in dataclasses.fields(_get_serve_request_context())}
    assert "_internal_request_id" in fields, moved(
        "the Serve request context's _internal_request_id", "pagedserve/router/app.py", f"fields {fields}"
    )
    meta = {f.name for f in dataclasses.fields(RequestMetadata)}
    assert "internal_request_id" in meta, moved(
        "RequestMetadata.internal_request_id", "pagedserve/router/prefix_router.py", f"fields {meta}"
    )
    for attr in ("replica_id", "routing_stats"):
        where = "pagedserve/router/prefix_router.py"
        assert hasattr(RunningReplica, attr), moved(f"RunningReplica.{attr}", where, "no such attribute")
    assert "_replica_id_set" in inspect.getsource(RequestRouter), moved(
        "RequestRouter._replica_id_set", "pagedserve/router/prefix_router.py", "no longer set there"
    )


def test_ray_is_the_pinned_minor_version() -> None:
    """pyproject.toml pins ray[serve] to one minor version: the one these tests ran on."""
    from pathlib import Path

    import tomllib
    from packaging.requirements import Requirement

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    [pin] = [Requirement(d) for d in project["project"]["dependencies"] if d.startswith("ray")]
    assert ray.__version__ in pin.specifier, f"Ray {ray.__version__} is outside the pin {pin}"
    assert not pin.specifier.contains("2.61.0") and not pin.specifier.contains("3.0.0"), (
        f"{pin}: pin Ray to the minor version tested here, not a range of minors"
    )
