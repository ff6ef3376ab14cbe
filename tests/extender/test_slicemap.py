"""The slice map's routes (extender/slicemap.py) and the loopback gate (extender/authgate.py).

The page and its assets hold no data and go out under a strict Content-Security-Policy; the data
route answers only past the gate, with what ``gpuslice.status`` says of the extender's own view.
Bearer tokens are reviewed by a real API server in ``test_slicemap_tokens.py``."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from extender.authgate import AuthGate
from extender.binder import MemoryBinder
from extender.service import Extender
from extender.slicemap import routes
from gpuslice.config import default_config
from tests.gpuslice.test_view import NOW, mig_gpu, mps_gpu, node_obj, pod_obj, sids


def extender() -> Extender:
    mps, mig = mps_gpu("n1", 0), mig_gpu("n1", 1, (("3g.40gb", 0), ("2g.20gb", 4), ("1g.10gb", 6)))
    ext = Extender(default_config(), MemoryBinder(), clock=lambda: NOW)
    ext.load([node_obj("n1", [mps, mig]),
              pod_obj("a", 4, node="n1", assigned=sids(mps.uuid, 4), allocated=sids(mps.uuid, 4)),
              pod_obj("big", 7)])
    return ext


class Client:
    """Requests straight into the ASGI app, from a client address of our choosing."""

    def __init__(self, app: Starlette, host: str = "127.0.0.1") -> None:
        self.transport = httpx.ASGITransport(app=app, client=(host, 40000))

    def get(self, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
        async def go() -> httpx.Response:
            async with httpx.AsyncClient(transport=self.transport, base_url="http://map") as c:
                return await c.get(path, headers=headers)
        return asyncio.run(go())


def client(mode: str = "loopback", host: str = "127.0.0.1") -> Client:
    return Client(Starlette(routes=routes(extender(), AuthGate(mode))), host)


def test_the_page_and_its_assets_carry_no_data_and_a_strict_policy() -> None:
    c = client(host="203.0.113.9")  # anyone who reaches the port gets the empty page
    page = c.get("/slicemap")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp and "unsafe" not in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    assert "ns/pod-a" not in page.text
    assert c.get("/slicemap/slicemap.js").headers["content-type"].startswith("text/javascript")
    assert c.get("/slicemap/slicemap.css").status_code == 200
    assert c.get("/slicemap/../app.py").status_code == 404
    assert c.get("/slicemap/secret.txt").status_code == 404


def test_the_page_sets_cluster_text_as_text_never_as_markup() -> None:
    """Pod names are written by tenants: the script must not parse them as HTML."""
    js = client().get("/slicemap/slicemap.js").text
    assert "innerHTML" not in js and "outerHTML" not in js and "insertAdjacentHTML" not in js
    assert "eval(" not in js and "document.write" not in js


def test_loopback_clients_get_the_status_and_others_are_refused() -> None:
    data: dict[str, Any] = client().get("/slicemap/api/status").json()
    assert data["kind"] == "ClusterStatus" and data["ready"] is True and data["slicesPerGpu"] == 7
    (node,) = data["nodes"]
    assert [g["mode"] for g in node["gpus"]] == ["mps", "mig"]
    assert node["gpus"][0]["units"][0]["holders"][0]["pod"] == "ns/pod-a"
    (pending,) = data["pending"]
    assert pending["pod"] == "ns/pod-big" and pending["suggestions"][0]["kind"] == "recut"
    refused = client(host="10.1.2.3").get("/slicemap/api/status")
    assert refused.status_code == 403 and "kubectl port-forward" in refused.json()["error"]
    assert refused.headers["cache-control"] == "no-store"


def test_a_token_gate_without_a_token_answers_401_with_how_to_get_one() -> None:
    app = Starlette(routes=routes(extender(), AuthGate("token", api=object())))
    resp = Client(app).get("/slicemap/api/status")
    assert resp.status_code == 401 and "bearer token" in resp.json()["error"]
    assert resp.headers["www-authenticate"].startswith("Bearer")
    resp = Client(app).get("/slicemap/api/status", headers={"Authorization": "Basic abc"})
    assert resp.status_code == 401


def test_gate_modes_are_checked() -> None:
    with pytest.raises(ValueError, match="token or loopback"):
        AuthGate("off")
    with pytest.raises(ValueError, match="API client"):
        AuthGate("token")


def test_one_status_serves_every_viewer_while_it_is_fresh() -> None:
    built: list[float] = []
    now = [100.0]

    def status(ext: Extender, limit: int | None) -> dict[str, Any]:
        built.append(now[0])
        return {"n": len(built)}

    app = Starlette(routes=routes(extender(), AuthGate("loopback"), status=status, cache_s=5.0,
                                  clock=lambda: now[0]))
    c = Client(app)
    assert [c.get("/slicemap/api/status").json()["n"] for _ in range(3)] == [1, 1, 1]
    now[0] += 5.0
    assert c.get("/slicemap/api/status").json()["n"] == 2 and built == [100.0, 105.0]


def test_a_slow_build_is_kept_ten_times_as_long() -> None:
    """The map holds the extender's lock at most a tenth of the time: a 2 s build serves 20 s."""
    now = [100.0]
    built: list[float] = []

    def status(ext: Extender, limit: int | None) -> dict[str, Any]:
        built.append(now[0])
        now[0] += 2.0  # the build takes 2 s
        return {"n": len(built)}

    c = Client(Starlette(routes=routes(extender(), AuthGate("loopback"), status=status, cache_s=5.0,
                                       clock=lambda: now[0])))
    assert c.get("/slicemap/api/status").json()["n"] == 1
    now[0] += 17.9
    assert c.get("/slicemap/api/status").json()["n"] == 1
    now[0] += 0.2
    assert c.get("/slicemap/api/status").json()["n"] == 2
