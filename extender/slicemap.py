"""The read-only web slice map: one rectangle per GPU with its slices coloured by pod or namespace,
the Pending pods with their reasons and suggestions, refreshed live.

It shows :func:`gpuslice.status.build_status` of the extender's own view (what ``gpu-slice status``
prints), so the map is what the extender decides on. Routes, for the ops port (DESIGN 4: never the
verbs port):

* ``GET /slicemap``, ``/slicemap/slicemap.js``, ``/slicemap/slicemap.css``: the static page, which
  holds no data (served to anyone who reaches the port);
* ``GET /slicemap/api/status``: the data, behind the :class:`extender.authgate.AuthGate`.

Tenant-controlled text (pod names, reasons) is only ever set as text by the page, never as markup,
and the page runs under a Content-Security-Policy that allows its own script and nothing else.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from importlib import resources
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from extender.authgate import AuthGate
from extender.service import Extender

#: Pending pods whose suggestions are worked out per refresh (highest priority first), and refused
#: nodes an eviction search tries per pod shape; the rest show reasons only. A build takes the
#: extender's lock one step at a time, but its CPU still competes with the verbs (one interpreter),
#: so a refresh must stay short: ``gpu-slice status`` is the unbounded look. Figures:
#: bench/bench_status.py, bench/RESULTS.md.
MAX_SUGGESTIONS = 20
EVICTION_NODES = 20
#: One status serves every viewer for this long: open pages never add up to more than one build.
CACHE_S = 5.0
#: ... and at least this many times as long as the last build took, so the map takes at most a tenth
#: of the interpreter's time however large the cluster (a 2 s build: one per 20 s).
DUTY = 10.0

_STATIC = {"slicemap.js": "text/javascript", "slicemap.css": "text/css"}
_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                                "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
}


def _asset(name: str) -> bytes:
    return resources.files("extender").joinpath("static", name).read_bytes()


def snapshot(ext: Extender, max_suggestions: int | None = MAX_SUGGESTIONS) -> dict[str, Any]:
    """The status as the slice map's JSON. The extender's lock is taken per step (the pod scan, one node,
    one Pending pod), so the verbs never wait for a whole build, only for one step."""
    from gpuslice.status import build_status

    st = build_status(ext.view, ext.sched, ext.clock(), max_suggestions=max_suggestions,
                      eviction_nodes=EVICTION_NODES, hold=lambda: ext.lock)
    data = st.to_dict()
    data["ready"] = ext.ready
    data["slicesPerGpu"] = ext.view.settings.slices_per_gpu
    return data


def routes(ext: Extender, gate: AuthGate, *, max_suggestions: int | None = MAX_SUGGESTIONS,
           status: Callable[[Extender, int | None], dict[str, Any]] = snapshot, cache_s: float = CACHE_S,
           clock: Callable[[], float] = time.monotonic) -> list[Route]:
    """The slice map's routes, to mount on the ops port's app."""
    page = _asset("slicemap.html")
    assets = {name: _asset(name) for name in _STATIC}
    kept: dict[str, tuple[float, float, bytes]] = {}  # "status" -> (built at, fresh for, body)
    building = threading.Lock()

    def body() -> bytes:
        """The cached status while fresh, else one new build (concurrent viewers wait for it)."""
        with building:
            hit = kept.get("status")
            if hit is not None and clock() - hit[0] < hit[1]:
                return hit[2]
            started = clock()
            data = json.dumps(status(ext, max_suggestions), separators=(",", ":")).encode()
            took = clock() - started
            kept["status"] = (started, max(cache_s, DUTY * took), data)
            return data

    async def index(_: Request) -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=_HEADERS)

    async def asset(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in assets:
            return Response("not found\n", status_code=404, media_type="text/plain", headers=_HEADERS)
        return Response(assets[name], media_type=_STATIC[name], headers=_HEADERS)

    async def api(request: Request) -> Response:
        verdict = await gate.check(request)
        headers = {**_HEADERS, "Cache-Control": "no-store"}
        if not verdict.allowed:
            if verdict.status == 401:
                headers["WWW-Authenticate"] = 'Bearer realm="gpu-slice"'
            return Response(json.dumps({"error": verdict.reason}), status_code=verdict.status,
                            media_type="application/json", headers=headers)
        return Response(await run_in_threadpool(body), media_type="application/json", headers=headers)

    return [Route("/slicemap", index, methods=["GET"]),
            Route("/slicemap/api/status", api, methods=["GET"]),
            Route("/slicemap/{name}", asset, methods=["GET"])]
