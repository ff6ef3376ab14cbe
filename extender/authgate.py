"""Who may read the ops port's read-only pages (the slice map lists every tenant's pods).

Two modes, chosen at start-up:

* ``token``: the request carries ``Authorization: Bearer <token>``; the API server says who that is
  (TokenReview) and whether that user may ``get`` the path asked (SubjectAccessReview on a
  non-resource URL), as kube-rbac-proxy and controller-runtime's metrics filter do. Grant it with a
  ClusterRole on ``nonResourceURLs: ["/slicemap", "/slicemap/*"]`` (manifests/scheduler/
  slicemap-rbac.yaml). Answers are cached for ``ttl_s`` per token and path, so a page refreshing
  every few seconds costs the API server one review pair per ``ttl_s``.
* ``loopback``: only clients on 127.0.0.1 or ::1, which from outside the pod means ``kubectl
  port-forward`` (itself gated by RBAC on ``pods/portforward``).

A refusal is 401 (no or bad token: the page asks for one) or 403 (known user, not allowed), with the
reason in the body. A review that cannot be made (API server down) is 503, never an open door.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from extender.errors import ExtenderError

MODES = ("off", "token", "loopback")
LOOPBACK = frozenset({"127.0.0.1", "::1"})
CACHE_SIZE = 1024


@dataclass(frozen=True, slots=True)
class Verdict:
    allowed: bool
    status: int = 200
    reason: str = ""
    user: str = ""


class ReviewError(ExtenderError):
    """The API server could not be asked (down, or the extender lacks system:auth-delegator)."""


class AuthGate:
    """See the module docstring. ``api`` is a ``kubernetes.client.ApiClient`` (token mode only)."""

    def __init__(self, mode: str, api: Any = None, *, ttl_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if mode not in MODES or mode == "off":
            raise ValueError(f"auth gate mode must be token or loopback, got {mode!r}")
        if mode == "token" and api is None:
            raise ValueError("token mode needs an API client for TokenReview and SubjectAccessReview")
        self.mode = mode
        self._api = api
        self._ttl = ttl_s
        self._clock = clock
        self._cache: OrderedDict[str, tuple[float, Verdict]] = OrderedDict()
        self._lock = threading.Lock()

    async def check(self, request: Request) -> Verdict:
        if self.mode == "loopback":
            host = request.client.host if request.client is not None else ""
            if host in LOOPBACK:
                return Verdict(True, user="loopback")
            return Verdict(False, 403, "this page is served only to loopback clients: use kubectl port-forward")
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return Verdict(False, 401, "send a bearer token (Authorization: Bearer <token>), for example from "
                                       "kubectl create token")
        if len(token) > 16384:
            return Verdict(False, 401, "the bearer token is too long")
        key = hashlib.sha256(f"{request.url.path}\0{token}".encode()).hexdigest()
        now = self._clock()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and hit[0] > now:
                return hit[1]
        try:
            verdict = await run_in_threadpool(self._review, token, request.url.path)
        except ReviewError as err:
            return Verdict(False, 503, str(err))
        with self._lock:
            self._cache[key] = (now + self._ttl, verdict)
            self._cache.move_to_end(key)
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return verdict

    def _post(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        """Create a TokenReview or SubjectAccessReview and return the API server's answer as JSON."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        create: Any = (client.AuthenticationV1Api(self._api).create_token_review if kind == "TokenReview"
                       else client.AuthorizationV1Api(self._api).create_subject_access_review)
        try:
            raw = create(body, _preload_content=False, _request_timeout=10)
            try:
                data = json.loads(raw.data)
            finally:
                raw.release_conn()
        except ApiException as err:
            raise ReviewError(f"cannot review the token: the API server answered {err.status} {err.reason} to a "
                              f"{kind} (the extender's service account needs system:auth-delegator)") from None
        except (OSError, ValueError) as err:
            raise ReviewError(f"cannot review the token: {err}") from None
        if not isinstance(data, dict):
            raise ReviewError(f"cannot review the token: a {kind} answered {type(data).__name__}")
        return data

    def _review(self, token: str, path: str) -> Verdict:
        review = self._post("TokenReview", {
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": token}})
        status = review.get("status") or {}
        if not status.get("authenticated"):
            why = status.get("error") or "the API server does not know this token"
            return Verdict(False, 401, f"token not accepted: {why}")
        user = status.get("user") or {}
        name = str(user.get("username") or "")
        sar = self._post("SubjectAccessReview", {
            "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
            "spec": {"user": name, "groups": user.get("groups") or [], "uid": user.get("uid") or "",
                     "extra": user.get("extra") or {},
                     "nonResourceAttributes": {"path": path, "verb": "get"}}})
        if (sar.get("status") or {}).get("allowed"):
            return Verdict(True, user=name)
        return Verdict(False, 403, f"user {name!r} may not get {path} (bind it to the ClusterRole "
                                   "gpu-slice-slicemap-reader)", user=name)
