"""The extender's HTTP surface: kube-scheduler's four verbs, health, readiness and metrics.

Routes (DESIGN 6): ``POST /filter``, ``/prioritize``, ``/bind``, ``/preempt``; ``GET /healthz``,
``/readyz``, ``/metrics``. Bodies over the size limit get 413, malformed ones 400 with the reason
(``{"Error": …}``), so kube-scheduler logs something an operator can act on; a logical refusal is
HTTP 200 with the ``Error`` field, as the protocol wants. Decisions are CPU-bound and short, so
they run on the event loop; ``/bind`` talks to the API server and runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

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


def build_app(ext: Extender, *, max_body: int = DEFAULT_MAX_BODY,
              ready: Callable[[], tuple[bool, str]] | None = None) -> Starlette:
    """The ASGI app over one :class:`Extender`. ``ready`` adds conditions (leadership catch-up)."""
    bind_pool = ThreadPoolExecutor(max_workers=BIND_WORKERS, thread_name_prefix="bind")

    def verb(name: str, handle: Callable[[bytes], Awaitable[Any]]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            started = time.perf_counter()
            outcome = "ok"
            try:
                body = await _body(request, max_body)
                result = await handle(body)
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

    async def do_filter(body: bytes) -> Any:
        args = wire.parse_extender_args(body, max_bytes=max_body)
        return ext.filter(args).to_json()

    async def do_prioritize(body: bytes) -> Any:
        return ext.prioritize(wire.parse_extender_args(body, max_bytes=max_body))

    async def do_bind(body: bytes) -> Any:
        args = wire.parse_binding_args(body, max_bytes=max_body)
        # A plain executor of the app's own: anyio's to_thread (Starlette's run_in_threadpool) adds a
        # capacity limiter and cancel scopes per call that /bind does not need on its hot path.
        return (await asyncio.get_running_loop().run_in_executor(bind_pool, ext.bind, args)).to_json()

    async def do_preempt(body: bytes) -> Any:
        return ext.preempt(wire.parse_preemption_args(body, max_bytes=max_body)).to_json()

    async def healthz(_: Request) -> Response:
        return Response("ok\n", media_type="text/plain")

    async def readyz(_: Request) -> Response:
        ok, why = (ext.ready, "cluster state not synced with the API server yet")
        if ok and ready is not None:
            ok, why = ready()
        ext.metrics.set_ready(ok)
        if ok:
            return Response("ok\n", media_type="text/plain")
        return Response(f"not ready: {why}\n", status_code=503, media_type="text/plain")

    async def metrics(_: Request) -> Response:
        ext.metrics.set_slices(ext.slice_rows())
        ext.metrics.set_reservations(len(ext.view.reservations))
        body, content_type = ext.metrics.render()
        return Response(body, media_type=content_type)

    routes = [
        Route("/filter", verb("filter", do_filter), methods=["POST"]),
        Route("/prioritize", verb("prioritize", do_prioritize), methods=["POST"]),
        Route("/bind", verb("bind", do_bind), methods=["POST"]),
        Route("/preempt", verb("preempt", do_preempt), methods=["POST"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    return Starlette(routes=routes)
