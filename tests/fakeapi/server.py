"""A real HTTP/1.1 server on 127.0.0.1 speaking the Kubernetes REST API for Pods, Nodes, Leases, Events and
PodDisruptionBudgets (with ``pods/binding`` and ``pods/eviction``).

It exists so that the services' real ``kubernetes`` client code (CoreV1Api, CoordinationV1Api, Watch)
runs over HTTP in tests. Watches use chunked transfer encoding like the real API server, which the
client's streaming reader needs. Fault injection sits in front of the routing so tests can make the
API server slow, failing, or failing *after* a write took effect (the "unclear error" case).
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import select
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from .store import RESOURCES, ApiError, Obj, Resource, Selector, Store, bad_request, gone

_REASONS = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 405: "MethodNotAllowed",
            409: "Conflict", 410: "Expired", 415: "UnsupportedMediaType", 422: "Invalid",
            429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable", 504: "Timeout"}


@dataclass
class Fault:
    """Applies to the next ``times`` requests whose verb and path match (see ``FakeApiServer.inject``)."""

    verb: str
    path: str
    times: int
    code: int | None = None
    delay: float = 0.0
    drop: bool = False
    commit: bool = False
    hits: int = 0

    def matches(self, verb: str, method: str, path: str) -> bool:
        return (self.verb in ("*", verb, method.lower())) and fnmatch.fnmatchcase(path, self.path)


@dataclass(frozen=True)
class Request:
    """One request as seen by the server, kept for assertions."""

    verb: str  # Kubernetes verb: get, list, watch, create, update, patch, delete, deletecollection
    method: str
    path: str
    query: dict[str, str] = field(default_factory=dict)
    content_type: str = ""
    body: Any = None  # the decoded request body (None when there was none)


@dataclass(frozen=True)
class _Route:
    res: Resource
    namespace: str | None
    name: str | None
    sub: str | None  # "status" or "binding"


def _route(path: str) -> _Route | None:
    parts = [p for p in path.split("/") if p]
    if parts[:2] == ["api", "v1"]:
        rest, api_version = parts[2:], "v1"
    elif len(parts) >= 3 and parts[0] == "apis":
        rest, api_version = parts[3:], f"{parts[1]}/{parts[2]}"
    else:
        return None
    namespace = None
    if len(rest) >= 3 and rest[0] == "namespaces":
        namespace, rest = rest[1], rest[2:]
    if not rest or len(rest) > 3:
        return None
    plural = rest[0]
    if namespace is not None and plural == "bindings" and api_version == "v1" and len(rest) == 1:
        return _Route(RESOURCES["pods"], namespace, None, "binding")  # legacy POST .../bindings
    res = RESOURCES.get(plural)
    if res is None or res.api_version != api_version or (namespace is not None and not res.namespaced):
        return None
    name = rest[1] if len(rest) >= 2 else None
    sub = rest[2] if len(rest) == 3 else None
    if sub is not None and not ((sub == "status" and res.has_status) or (sub in ("binding", "eviction")
                                                                         and plural == "pods")):
        return None
    if res.namespaced and name is not None and namespace is None:
        return None
    return _Route(res, namespace, name, sub)


def _truthy(value: str | None) -> bool:
    return value is not None and value.lower() in ("true", "1")


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def __init__(self, api: FakeApiServer) -> None:
        self.api = api
        self.connections: set[socket.socket] = set()
        self.conn_lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Handler)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        with self.conn_lock:
            self.connections.add(request)
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.conn_lock:
                self.connections.discard(request)

    def close_connections(self) -> None:
        with self.conn_lock:
            conns = list(self.connections)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in separate writes; avoid 40 ms ACK stalls
    server: _HTTPServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._dispatch()

    do_POST = do_PUT = do_PATCH = do_DELETE = do_GET

    # ---- plumbing

    def _send_json(self, code: int, body: Obj) -> None:
        data = json.dumps(body, separators=(",", ":")).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, err: ApiError) -> None:
        self._send_json(err.code, err.status())

    def _read_body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError as e:
            raise bad_request(f"couldn't get version/kind; json parse error: {e}") from e

    def _dispatch(self) -> None:
        api = self.server.api
        url = urlsplit(self.path)
        path = url.path.rstrip("/") or "/"
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        method = self.command
        route = _route(path)
        verb = _verb(method, route, query)
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip()
        try:
            body = self._read_body()
        except ApiError as e:
            self._send_error(e)
            return
        api._record(Request(verb, method, path, query, content_type, body))
        fault = api._take_fault(verb, method, path)
        if fault is not None:
            if fault.delay and api._stopping.wait(fault.delay):
                self.close_connection = True
                return
            if fault.drop:
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            if fault.code is not None and not fault.commit:
                self._send_error(_fault_error(fault.code))
                return
        try:
            if path in ("/version", "/healthz", "/readyz", "/livez"):
                result: tuple[int, Obj] = (200, {"major": "1", "minor": "33", "gitVersion": "v1.33.0-fake"})
            elif route is None:
                raise ApiError(404, "NotFound", "the server could not find the requested resource",
                               {"causes": [{"reason": "UnexpectedServerResponse", "message": "404 page not found"}]})
            elif verb == "watch":
                self._watch(route, query)
                return
            else:
                result = _handle(api.store, verb, route, query, body, content_type)
        except ApiError as e:
            self._send_error(e)
            return
        except (ValueError, TypeError, KeyError, AttributeError) as e:  # a malformed request: say so
            self._send_error(ApiError(400, "BadRequest", f"fake API server cannot handle this request: "
                                      f"{type(e).__name__}: {e}"))
            return
        if fault is not None and fault.code is not None:
            self._send_error(_fault_error(fault.code))  # committed, but the client hears a failure
            return
        self._send_json(*result)

    # ---- watch

    def _watch(self, route: _Route, query: dict[str, str]) -> None:
        store, res = self.server.api.store, route.res
        selector = Selector.parse(res, query.get("fieldSelector"), query.get("labelSelector"))
        timeout = float(query.get("timeoutSeconds") or self.server.api.max_watch_seconds)
        timeout = min(timeout, self.server.api.max_watch_seconds)
        deadline = time.monotonic() + timeout
        rv_text = query.get("resourceVersion") or ""
        if rv_text not in ("", "0") and not rv_text.isdigit():
            raise bad_request(f'resourceVersion: Invalid value: "{rv_text}": must be a decimal integer')
        initial: list[tuple[str, Obj]] = []
        if rv_text in ("", "0"):  # start "now": synthetic ADDED for the current state, as the real server
            items, cursor = store.list(res.plural, route.namespace, selector)
            for item in items:
                item["kind"], item["apiVersion"] = res.kind, res.api_version
                initial.append(("ADDED", item))
        else:
            cursor = int(rv_text)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for type_, obj in initial:
                self._chunk({"type": type_, "object": obj})
            while True:
                batch = store.events_after(cursor, res.plural)
                if batch is None:
                    err = gone(f"too old resource version: {cursor} ({store.compacted_rv})")
                    self._chunk({"type": "ERROR", "object": err.status()})
                    break
                events, upto = batch
                moved, cursor = upto != cursor, upto
                for event in events:
                    if route.namespace in (None, event.obj["metadata"].get("namespace")):
                        out = _filtered(event.type, event.obj, event.old, selector)
                        if out is not None:
                            self._chunk({"type": out, "object": event.obj})
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if _truthy(query.get("allowWatchBookmarks")):
                        self._chunk({"type": "BOOKMARK", "object": {
                            "kind": res.kind, "apiVersion": res.api_version,
                            "metadata": {"resourceVersion": str(cursor)}}})
                    break
                if store.closed or self._peer_closed():
                    self.close_connection = True
                    break
                with store.cond:
                    if not moved and store.resource_version <= cursor and not store.closed:
                        store.cond.wait(min(remaining, 0.5))
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            self.close_connection = True

    def _chunk(self, event: Obj) -> None:
        data = json.dumps(event, separators=(",", ":")).encode() + b"\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _peer_closed(self) -> bool:
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True



def _fault_error(code: int) -> ApiError:
    return ApiError(code, _REASONS.get(code, "Unknown"), f"injected fault: HTTP {code}")


def _verb(method: str, route: _Route | None, query: dict[str, str]) -> str:
    named = route is not None and route.name is not None
    if method == "GET":
        if _truthy(query.get("watch")):
            return "watch"
        return "get" if named else "list"
    if method == "DELETE":
        return "delete" if named else "deletecollection"
    return {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, method.lower())


def _filtered(type_: str, obj: Obj, old: Obj | None, selector: Selector) -> str | None:
    """Translate an event for a selector-filtered watch, as the API server's watch cache does."""
    if type_ == "ADDED":
        return "ADDED" if selector.matches(obj) else None
    if type_ == "DELETED":
        return "DELETED" if selector.matches(old if old is not None else obj) else None
    now, before = selector.matches(obj), selector.matches(old)
    if now and before:
        return "MODIFIED"
    if now:
        return "ADDED"
    return "DELETED" if before else None


def _list_body(res: Resource, items: list[Obj], rv: int, cont: str = "") -> Obj:
    for item in items:  # items of a typed list carry no kind/apiVersion on the wire
        item.pop("kind", None)
        item.pop("apiVersion", None)
    metadata: Obj = {"resourceVersion": str(rv)}
    if cont:
        metadata["continue"] = cont
    return {"kind": f"{res.kind}List", "apiVersion": res.api_version, "metadata": metadata, "items": items}


def _handle(store: Store, verb: str, route: _Route, query: dict[str, str], body: Any,
            content_type: str) -> tuple[int, Obj]:
    res, ns, name, sub = route.res, route.namespace, route.name, route.sub
    if "dryRun" in query:
        raise bad_request("dryRun is not supported by the fake API server")
    if sub == "eviction":
        if verb != "create" or not isinstance(body, dict) or name is None:
            raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the "
                           "requested resource")
        assert ns is not None
        store.evict(ns, name, body)
        return 201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}
    if sub == "binding":
        if verb != "create":
            raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the "
                           "requested resource")
        if not isinstance(body, dict):
            raise bad_request("a v1 Binding body is required")
        pod = name or (body.get("metadata") or {}).get("name") or ""
        assert ns is not None
        store.bind(ns, pod, body)
        return 201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}
    if verb == "get":
        assert name is not None
        return 200, store.get(res.plural, name, ns)
    if verb in ("list", "deletecollection"):
        selector = Selector.parse(res, query.get("fieldSelector"), query.get("labelSelector"))
        items, rv = store.list(res.plural, ns, selector)
        if verb == "deletecollection":
            deleted = [store.delete(res.plural, i["metadata"]["name"], i["metadata"].get("namespace"), body)
                       for i in items]
            return 200, _list_body(res, deleted, store.resource_version)
        return 200, _paginate(store, res, items, rv, query)
    if verb == "create":
        if name is not None:
            raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the "
                           "requested resource")
        if not isinstance(body, dict):
            raise bad_request(f"a {res.kind} body is required")
        return 201, store.create(res.plural, body, ns)
    assert name is not None
    if verb == "update":
        if not isinstance(body, dict):
            raise bad_request(f"a {res.kind} body is required")
        return 200, store.replace(res.plural, name, ns, body, sub)
    if verb == "patch":
        return 200, store.patch(res.plural, name, ns, content_type, body, sub)
    if verb == "delete":
        if sub is not None:
            raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the "
                           "requested resource")
        options = dict(body) if isinstance(body, dict) else {}
        if "gracePeriodSeconds" in query:
            options["gracePeriodSeconds"] = int(query["gracePeriodSeconds"])
        return 200, store.delete(res.plural, name, ns, options)
    raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")


def _paginate(store: Store, res: Resource, items: list[Obj], rv: int, query: dict[str, str]) -> Obj:
    """limit/continue. A continue token is "<rv>:<index>"; it expires (410) once history is compacted
    past its version. Later pages are cut from the current state, not a snapshot."""
    start = 0
    token = query.get("continue") or ""
    if token:
        try:
            token_rv, start = (int(x) for x in token.split(":"))
        except ValueError as e:
            raise bad_request(f"continue key is not valid: {token}") from e
        if token_rv < store.compacted_rv:
            raise gone("The provided continue parameter is too old to display a consistent list result. "
                       "You can start a new list without the continue parameter, or use the continue "
                       "token in this response to retrieve the remainder of the results. Continuing with "
                       "the provided token results in an inconsistent list - objects that were created, "
                       "modified, or deleted between the time the first chunk was returned and now may "
                       "show up in the list.")
        rv = token_rv
    limit = int(query.get("limit") or 0)
    page = items[start:start + limit] if limit > 0 else items[start:]
    cont = f"{rv}:{start + limit}" if limit > 0 and start + limit < len(items) else ""
    return _list_body(res, page, rv, cont)


class FakeApiServer:
    """The fake API server: ``with FakeApiServer() as api: api.client()`` or the ``fake_api`` fixture.

    ``history_size`` bounds the watch history (older versions get 410); ``max_watch_seconds`` caps every
    watch so forgotten watchers end; ``graceful_pod_deletion`` makes deleting a bound, running pod set
    ``deletionTimestamp`` (a second delete with ``grace_period_seconds=0`` removes it) like kubelet-backed
    clusters, instead of removing it at once.
    """

    def __init__(self, *, history_size: int = 1000, max_watch_seconds: float = 60.0,
                 graceful_pod_deletion: bool = False) -> None:
        self.store = Store(history_size=history_size, graceful_pod_deletion=graceful_pod_deletion)
        self.max_watch_seconds = max_watch_seconds
        self.requests: list[Request] = []
        self.counts: Counter[tuple[str, str]] = Counter()
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._clients: list[Any] = []

    # ---- lifecycle

    def start(self) -> FakeApiServer:
        if self._httpd is None:
            self._httpd = _HTTPServer(self)
            self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                            name="fake-kube-apiserver", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving; open watches end at once, idle keep-alive connections are closed."""
        if self._httpd is None:
            return
        self._stopping.set()
        self.store.close()
        for api_client in self._clients:
            with contextlib.suppress(Exception):
                api_client.close()
        self._httpd.shutdown()
        self._httpd.close_connections()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._httpd = None

    def __enter__(self) -> FakeApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._httpd is not None, "server not started"
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ---- clients

    def configuration(self) -> Any:
        """A ``kubernetes.client.Configuration`` pointing at this server (no auth, plain HTTP)."""
        from kubernetes import client

        config = client.Configuration()
        config.host = self.url
        return config

    def client(self, **settings: Any) -> Any:
        """A ``kubernetes.client.ApiClient`` for this server, closed when the server stops.

        ``settings`` are set on the Configuration first (e.g. ``retries=False``)."""
        from kubernetes import client

        config = self.configuration()
        for key, value in settings.items():
            setattr(config, key, value)
        api_client = client.ApiClient(config)
        self._clients.append(api_client)
        return api_client

    # ---- fault injection and request accounting

    def inject(self, verb: str = "*", path: str = "*", *, code: int | None = None, delay: float = 0.0,
               drop: bool = False, commit: bool = False, times: int = 1) -> Fault:
        """Make the next ``times`` requests matching ``verb`` and ``path`` misbehave.

        ``verb``: a Kubernetes verb (get, list, watch, create, update, patch, delete, deletecollection),
        an HTTP method, or "*". ``path``: an fnmatch pattern on the URL path (``*`` also crosses "/"),
        e.g. ``/api/v1/namespaces/*/pods/*/binding``. Effects, in order: wait ``delay`` seconds; ``drop``
        closes the connection without an answer; ``code`` answers that HTTP status as a Status object,
        before the request takes effect, or after it if ``commit`` (the write happened; the client sees
        an error). With only ``delay``, the request then proceeds normally.
        """
        fault = Fault(verb.lower() if verb != "*" else "*", path, times, code, delay, drop, commit)
        with self._lock:
            self._faults.append(fault)
        return fault

    def fail_next(self, verb: str, path: str, code: int = 500, times: int = 1, commit: bool = False) -> Fault:
        return self.inject(verb, path, code=code, times=times, commit=commit)

    def hang_next(self, verb: str, path: str, seconds: float, times: int = 1) -> Fault:
        return self.inject(verb, path, delay=seconds, times=times)

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def _take_fault(self, verb: str, method: str, path: str) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.matches(verb, method, path):
                    fault.hits += 1
                    if fault.hits >= fault.times:
                        self._faults.remove(fault)
                    return fault
        return None

    def _record(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)
            self.counts[(request.verb, request.path)] += 1

    def request_count(self, verb: str = "*", path: str = "*") -> int:
        """How many requests matched ``verb`` (Kubernetes verb or HTTP method) and the ``path`` pattern."""
        with self._lock:
            return sum(
                1 for r in self.requests
                if verb in ("*", r.verb, r.method.lower(), r.method) and fnmatch.fnmatchcase(r.path, path)
            )

    def reset_counts(self) -> None:
        with self._lock:
            self.requests.clear()
            self.counts.clear()
