"""The extender's HTTP surface, on two ports: kube-scheduler's verbs, and health, readiness and metrics.

``build_verbs_app``: ``POST /filter``, ``/prioritize``, ``/bind``, ``/preempt``, served where only
kube-scheduler reaches them (127.0.0.1 in the scheduler pod, or TLS with client certificates,
DESIGN 4). ``build_ops_app``: ``GET /healthz``, ``/readyz``, ``/metrics`` and whatever read-only
routes the caller adds (``routes=``: the slice map mounts there), served on the pod IP for kubelet's
probes and Prometheus. ``build_app`` puts both on one app, for tests and dry runs.

Bodies over the size limit get 413, malformed ones 400 with the reason (``{"Error": …}``), so
kube-scheduler logs something an operator can act on; a logical refusal is HTTP 200 with the
``Error`` field, as the protocol wants, and is counted as ``refused``. Decisions are CPU-bound and
short, so they run on the event loop; anything that talks to the API server runs in a worker thread
(``/bind`` always; ``/filter`` and ``/preempt`` when they must read a pod or a node's pods first).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from extender import wire
from extender.errors import WireError
from extender.service import Extender

log = logging.getLogger("gpu_slice.extender")

JSON = "application/json"
DEFAULT_MAX_BODY = 16 * 1024 * 1024  # a NodeList of 5,000 nodes is a few MB
#: Threads for /bind's API call (kube-scheduler binds in parallel goroutines; each bind is one write that
#: waits on the API server, not the CPU): 16 carry 100s of binds a second at tens of ms each, and every
#: thread and pooled TLS connection beyond what is used at once is resident memory for nothing.
BIND_WORKERS = 16


class BodyTooLarge(Exception):
    pass


#: After refusing an oversized body, read and drop up to this many times the limit (for at most
#: ``DISCARD_SECONDS``) before answering, as nginx's lingering close does: a client still sending
#: would otherwise see its connection reset instead of the 413 that says why.
DISCARD_FACTOR = 4
DISCARD_SECONDS = 10.0


async def _discard(request: Request, budget: int) -> None:
    async def drain() -> None:
        left = budget
        async for chunk in request.stream():
            left -= len(chunk)
            if left < 0:
                return
    with contextlib.suppress(Exception):  # the client went away or was too slow: nothing to answer then
        await asyncio.wait_for(drain(), DISCARD_SECONDS)


async def _body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise WireError("Content-Length is not a number") from None
        if size > limit:
            if size <= DISCARD_FACTOR * limit:
                await _discard(request, size)
            raise BodyTooLarge
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            await _discard(request, DISCARD_FACTOR * limit)
            raise BodyTooLarge
        chunks.append(chunk)
    return b"".join(chunks)


def _json(value: Any, status: int = 200) -> Response:
    return Response(wire.encode(value), status_code=status, media_type=JSON)


def _verb(ext: Extender, name: str, handle: Callable[[bytes], Awaitable[Any]],
          max_body: int) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        started = time.perf_counter()
        outcome = "ok"
        try:
            body = await _body(request, max_body)
            result = await handle(body)
            if isinstance(result, dict) and result.get("Error"):
                outcome = "refused"
            return _json(result)
        except BodyTooLarge:
            outcome = "bad_request"
            return _json({"Error": f"request body over {max_body} bytes"}, 413)
        except WireError as err:
            outcome = "bad_request"
            return _json({"Error": f"bad {name} request: {err}"}, 400)
        except Exception as err:
            outcome = "error"
            log.exception("%s failed", name)
            return _json({"Error": f"{name} failed: {type(err).__name__}: {err}"}, 500)
        finally:
            ext.metrics.observe_request(name, time.perf_counter() - started, outcome)

    return endpoint


def verb_routes(ext: Extender, *, max_body: int = DEFAULT_MAX_BODY) -> list[BaseRoute]:
    """kube-scheduler's four verbs over one :class:`Extender`."""
    # A plain executor of the app's own for the verbs that wait on the API server: anyio's to_thread
    # (Starlette's run_in_threadpool) adds a capacity limiter and cancel scopes per call that /bind
    # does not need on its hot path.
    io_pool = ThreadPoolExecutor(max_workers=BIND_WORKERS, thread_name_prefix="bind")

    async def off_loop(fn: Callable[[Any], Any], args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(io_pool, fn, args)

    async def do_filter(body: bytes) -> Any:
        args = wire.parse_extender_args(body, max_bytes=max_body)
        if ext.filter_needs_io(args):  # a pod to confirm, or a nominated node to read: off the loop
            return (await off_loop(ext.filter, args)).to_json()
        return ext.filter(args).to_json()

    async def do_prioritize(body: bytes) -> Any:
        return ext.prioritize(wire.parse_extender_args(body, max_bytes=max_body))

    async def do_bind(body: bytes) -> Any:
        args = wire.parse_binding_args(body, max_bytes=max_body)
        return (await off_loop(ext.bind, args)).to_json()

    async def do_preempt(body: bytes) -> Any:
        args = wire.parse_preemption_args(body, max_bytes=max_body)
        return (await off_loop(ext.preempt, args)).to_json()

    return [
        Route("/filter", _verb(ext, "filter", do_filter, max_body), methods=["POST"]),
        Route("/prioritize", _verb(ext, "prioritize", do_prioritize, max_body), methods=["POST"]),
        Route("/bind", _verb(ext, "bind", do_bind, max_body), methods=["POST"]),
        Route("/preempt", _verb(ext, "preempt", do_preempt, max_body), methods=["POST"]),
    ]


def ops_routes(ext: Extender, *, ready: Callable[[], tuple[bool, str]] | None = None) -> list[BaseRoute]:
    """``/healthz``, ``/readyz`` (``ready`` adds conditions, e.g. leadership catch-up) and ``/metrics``."""

    async def healthz(_: Request) -> Response:
        return Response("ok\n", media_type="text/plain")

    async def readyz(_: Request) -> Response:
        why = ext.not_ready()
        ok = not why
        if ok and ready is not None:
            ok, why = ready()
        if ok:
            return Response("ok\n", media_type="text/plain")
        return Response(f"not ready: {why}\n", status_code=503, media_type="text/plain")

    async def metrics(_: Request) -> Response:
        ext.metrics.set_slices(ext.slice_rows())
        ext.metrics.set_reservations(len(ext.view.reservations))
        ext.metrics.set_ready(not ext.not_ready())
        ext.metrics.set_leader(ext.fence.holds())
        body, content_type = ext.metrics.render()
        return Response(body, media_type=content_type)

    return [
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]


def build_verbs_app(ext: Extender, *, max_body: int = DEFAULT_MAX_BODY) -> Starlette:
    """The verbs alone: serve it where only kube-scheduler can reach it."""
    return Starlette(routes=verb_routes(ext, max_body=max_body))


def build_ops_app(ext: Extender, *, ready: Callable[[], tuple[bool, str]] | None = None,
                  routes: Sequence[BaseRoute] = ()) -> Starlette:
    """Probes and metrics, plus ``routes``: extra read-only routes (Starlette ``Route``/``Mount``
    objects, e.g. the slice map) served beside them on the ops port. A route may not take a path of
    the verbs or of the probes."""
    base = ops_routes(ext, ready=ready)
    taken = {"/filter", "/prioritize", "/bind", "/preempt"} | {getattr(r, "path", "") for r in base}
    for r in routes:
        path = getattr(r, "path", "")
        if path in taken:
            raise ValueError(f"an ops route may not take {path!r}: it is the extender's own")
    return Starlette(routes=[*base, *routes])


def build_app(ext: Extender, *, max_body: int = DEFAULT_MAX_BODY,
              ready: Callable[[], tuple[bool, str]] | None = None) -> Starlette:
    """Verbs, probes and metrics on one app: for tests and ``--cluster`` dry runs in one process. A
    deployment serves :func:`build_verbs_app` and :func:`build_ops_app` on ports of their own."""
    return Starlette(routes=[*verb_routes(ext, max_body=max_body), *ops_routes(ext, ready=ready)])
