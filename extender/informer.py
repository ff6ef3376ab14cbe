"""List+watch of Nodes and Pods into a handler, the extender's only view of the cluster.

Like client-go's reflector: list (in pages) then watch from the list's resourceVersion, with
``allowWatchBookmarks`` so an idle watch still advances the version and a reconnect does not fall
behind the API server's history; a watch that ends (server timeout, dropped connection, an ERROR
event other than 410) is resumed from the last version seen; a 410 Gone (as the HTTP status of the
watch request or as an ERROR event in its stream) means the history is gone, so the kind is listed
again and the handler's ``on_relist`` replaces everything it held of that kind. Errors back off
exponentially with jitter (bounded), and the backoff resets once a list or a watch succeeds.

Objects stay the API server's plain JSON dicts (``_preload_content=False``): the client's model
objects cost several times the memory and the core reads dicts anyway. ``metadata.managedFields``
is dropped on arrival by the default ``transform`` (often half of an object's size, never read).
By default pods that have finished (Succeeded, Failed) are not listed: they hold no slices (DESIGN 3,
counting rule), and a pod that finishes arrives as DELETED.

Each kind runs on its own daemon thread (the kubernetes client is synchronous). Handler calls are
serialised by one lock, so a handler sees one call at a time whichever thread delivers it.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from extender.errors import KubeApiError
from extender.logs import RateLimitedLog

log = logging.getLogger(__name__)

Obj = dict[str, Any]
Kind = Literal["Node", "Pod", "PodDisruptionBudget"]
EventType = Literal["ADDED", "MODIFIED", "DELETED"]
KINDS: tuple[Kind, ...] = ("Node", "Pod", "PodDisruptionBudget")

#: ``on_relist_metric`` reasons and ``on_error_metric`` codes: short, fixed sets for metric labels.
RELIST_REASONS = ("initial", "gone", "requested")
ERROR_CODES = ("transport", "http_4xx", "http_5xx", "watch_error", "decode", "handler", "short_watch")
#: A watch that ends cleanly sooner than this without delivering a change (bookmarks do not count) is
#: not re-opened at once (client-go's reflector calls it a "very short watch"): a proxy or an
#: overloaded API server closing every watch at once would otherwise meet a hot loop of new watches.
MIN_WATCH_S = 1.0
#: Finished pods hold no slices; leaving them out saves memory in clusters with many Jobs.
DEFAULT_POD_FIELD_SELECTOR = "status.phase!=Succeeded,status.phase!=Failed"


class InformerHandler(Protocol):
    """Receives the cluster's Nodes and Pods. Calls are serialised; they must not block for long."""

    def on_event(self, kind: Kind, type: EventType, obj: Any) -> None:
        """One change (the object as ``transform`` made it). DELETED carries the object's last state."""

    def on_relist(self, kind: Kind, objs: list[Any]) -> None:
        """The complete current set of ``kind``: drop every object of that kind not in ``objs``."""


def strip_managed_fields(kind: Kind, obj: Obj) -> Obj:
    """The default transform: ``metadata.managedFields`` is large and nothing here reads it."""
    meta = obj.get("metadata")
    if isinstance(meta, dict):
        meta.pop("managedFields", None)
    return obj


@dataclass
class Backoff:
    """Exponential backoff with proportional jitter: ``initial * factor**n``, capped at ``maximum``.

    Jitter spreads reconnects of many replicas after an API server restart; the cap holds after
    jitter too, so the wait is always bounded by ``maximum``.
    """

    initial: float = 0.5
    maximum: float = 30.0
    factor: float = 2.0
    jitter: float = 0.25
    rng: random.Random = field(default_factory=random.Random)
    _attempt: int = 0

    def next(self) -> float:
        base = min(self.maximum, self.initial * self.factor ** min(self._attempt, 64))
        self._attempt += 1
        spread = base * self.jitter
        return max(0.0, min(self.maximum, base + self.rng.uniform(-spread, spread)))

    def reset(self) -> None:
        self._attempt = 0

    @property
    def attempts(self) -> int:
        return self._attempt


class _Gone(Exception):
    """410: the resourceVersion we hold is older than the API server's history; list again."""


class _Aborted(Exception):
    """The stream was closed on purpose (stop or a requested relist)."""


class _ShortWatch(Exception):
    """The watch ended cleanly at once, having delivered nothing: back off before the next."""


class _Stream:
    """The list+watch loop of one kind."""

    def __init__(self, informer: Informer, kind: Kind, call: Callable[..., Any], selectors: dict[str, str]) -> None:
        self.informer = informer
        self.kind = kind
        self.call = call
        self.selectors = selectors
        self.rv = ""
        self.need_list = True
        self.list_reason = "initial"
        self.listed_gen = -1  # the informer's relist generation that the last list covers
        self.lists = 0
        self.resp: Any = None
        self.force_relist = False
        self.fresh_list = False  # listed, and the watch since has delivered nothing yet
        self.thread: threading.Thread | None = None

    # ---- the loop

    def run(self) -> None:
        inf = self.informer
        backoff = inf._backoff_factory()
        while not inf._stop.is_set():
            try:
                if self.force_relist:
                    self.force_relist, self.need_list, self.list_reason = False, True, "requested"
                if self.need_list:
                    self._list()
                    backoff.reset()
                self._watch(backoff)
            except _Aborted:
                continue
            except _ShortWatch:
                inf._count_error(self.kind, "short_watch")
                delay = backoff.next()
                inf._warn.warning(f"{self.kind}-short", "%s watch closed at once without events; reopening in "
                                  "%.1fs", self.kind, delay)
                if inf._stop.wait(delay):
                    return
            except _Gone:
                self.need_list, self.list_reason = True, "gone"
                # A 410 before the watch from a fresh list delivered anything: do not spin; wait.
                if self.fresh_list and inf._stop.wait(backoff.next()):
                    return
            except Exception as exc:
                if inf._stop.is_set():
                    return
                if self.force_relist:
                    continue
                inf._count_error(self.kind, _classify(exc))
                delay = backoff.next()
                inf._warn.warning(f"{self.kind}-error", "%s list/watch failed (%s); retrying in %.1fs",
                                  self.kind, _describe(exc), delay)
                if inf._stop.wait(delay):
                    return

    # ---- list

    def _list(self) -> None:
        inf = self.informer
        gen = inf._relist_gen
        items: list[Any] = []
        rv = ""
        cont = ""
        while True:
            if inf._stop.is_set():
                raise _Aborted
            kwargs: dict[str, Any] = dict(self.selectors)
            if inf.page_size:
                kwargs["limit"] = inf.page_size
            if cont:
                kwargs["_continue"] = cont
            try:
                page = _json_body(_call(self.call, _preload_content=False,
                                        _request_timeout=inf.request_timeout_s, **kwargs), f"list {self.kind}s")
            except _Gone:
                if not cont:
                    raise
                log.info("%s list continue token expired; listing from the start", self.kind)
                items, rv, cont = [], "", ""
                continue
            meta = page.get("metadata") or {}
            if not rv:
                rv = str(meta.get("resourceVersion") or "")
            raw = page.get("items") or []
            if not isinstance(raw, list):
                raise KubeApiError(f"list {self.kind}s: items is not an array")
            items.extend(inf._transform(self.kind, obj) for obj in raw if isinstance(obj, dict))
            cont = str(meta.get("continue") or "")
            if not cont:
                break
        if not rv:
            raise KubeApiError(f"list {self.kind}s: the answer has no resourceVersion")
        inf._deliver_relist(self.kind, items)
        self.rv, self.need_list, self.listed_gen, self.fresh_list = rv, False, gen, True
        self.lists += 1
        inf._after_list(self, self.list_reason)

    # ---- watch

    def _watch(self, backoff: Backoff) -> None:
        """One watch request, read to its end (the server's timeout, or the connection closing)."""
        inf = self.informer
        resp = _call(self.call, watch=True, resource_version=self.rv, allow_watch_bookmarks=True,
                     timeout_seconds=inf.watch_timeout_s, _preload_content=False,
                     _request_timeout=(inf.request_timeout_s, inf.watch_timeout_s + inf.request_timeout_s),
                     **self.selectors)
        with inf._lock:
            self.resp = resp
            aborted = inf._stop.is_set() or self.force_relist
        clean = False
        opened = time.monotonic()
        delivered = 0
        try:
            if aborted:
                raise _Aborted
            for line in _lines(resp):
                if inf._stop.is_set() or self.force_relist:
                    raise _Aborted
                if self._event(line) != "BOOKMARK":
                    delivered += 1
                if self.fresh_list:
                    self.fresh_list = False
                    backoff.reset()
            clean = True
            if not delivered and time.monotonic() - opened < inf.min_watch_s:
                raise _ShortWatch
            backoff.reset()
        except (_Aborted, _ShortWatch):
            raise
        except Exception:
            if inf._stop.is_set() or self.force_relist:
                raise _Aborted from None
            raise
        finally:
            with inf._lock:
                self.resp = None
            if not clean:
                resp.close()
            resp.release_conn()

    def _event(self, line: bytes) -> str:
        """Apply one watch line; returns its event type."""
        try:
            event = json.loads(line)
        except ValueError as exc:
            raise KubeApiError(f"watch {self.kind}s: an event is not JSON ({exc})") from None
        if not isinstance(event, dict) or not isinstance(event.get("object"), dict):
            raise KubeApiError(f"watch {self.kind}s: an event is not an object with an object")
        type_, obj = event.get("type"), event["object"]
        if type_ == "ERROR":
            code = obj.get("code")
            if code == 410:
                raise _Gone
            raise KubeApiError(f"watch {self.kind}s: ERROR event {code} {obj.get('reason')}: "
                               f"{obj.get('message')}", code if isinstance(code, int) else None)
        meta = obj.get("metadata")
        rv = str(meta.get("resourceVersion") or "") if isinstance(meta, dict) else ""
        if type_ in ("ADDED", "MODIFIED", "DELETED"):
            self.informer._deliver_event(self.kind, type_, self.informer._transform(self.kind, obj))
        elif type_ != "BOOKMARK":
            log.debug("%s watch: ignoring event type %r", self.kind, type_)
        if rv:
            self.rv = rv
        return str(type_)

    def abort(self) -> None:
        """Close the open watch so its thread notices stop or a requested relist at once."""
        resp = self.resp
        if resp is not None:
            try:
                resp.shutdown()
            except Exception:  # already closed, or an urllib3 without shutdown()
                log.debug("closing the %s watch", self.kind, exc_info=True)


def _lines(resp: Any) -> Iterator[bytes]:
    """The newline-delimited JSON events of a chunked watch response, as they arrive."""
    buf = bytearray()
    for chunk in resp.stream(amt=None, decode_content=False):
        buf.extend(chunk)
        start = 0
        while (end := buf.find(b"\n", start)) != -1:
            if end > start:
                yield bytes(buf[start:end])
            start = end + 1
        del buf[:start]
    if buf.strip():
        yield bytes(buf)


def _call(fn: Callable[..., Any], **kwargs: Any) -> Any:
    """Call the client; an HTTP 410 (expired resourceVersion or continue token) becomes ``_Gone``."""
    try:
        return fn(**kwargs)
    except Exception as exc:
        if _status(exc) == 410:
            raise _Gone from None
        raise


def _json_body(resp: Any, what: str) -> Obj:
    try:
        data = json.loads(resp.data)
    except ValueError as exc:
        raise KubeApiError(f"{what}: the API server answered something other than JSON ({exc})") from None
    finally:
        resp.release_conn()
    if not isinstance(data, dict):
        raise KubeApiError(f"{what}: expected a JSON object, got {type(data).__name__}")
    return data


def _status(exc: BaseException) -> int | None:
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) and status > 0 else None


def _classify(exc: BaseException) -> str:
    """A short, bounded error code for metrics."""
    if isinstance(exc, KubeApiError):
        return "watch_error" if exc.status is not None else "decode"
    status = _status(exc)
    if status is not None:
        return "http_5xx" if status >= 500 else "http_4xx"
    return "transport"


def _describe(exc: BaseException) -> str:
    status = _status(exc)
    if status is not None:
        return f"HTTP {status} {getattr(exc, 'reason', '') or ''}".strip()
    return f"{type(exc).__name__}: {exc}"[:300]


class Informer:
    """Nodes and Pods from the API server into ``handler``; ``start``, ``wait_synced``, ``stop``.

    ``watch_timeout_s`` is the server-side timeout of each watch request (they are resumed at once),
    ``request_timeout_s`` bounds lists and connection set-up. ``on_relist_metric(kind, reason)``
    (reason: initial, gone, requested) and ``on_error_metric(kind, code)`` (code: transport, http_4xx,
    http_5xx, watch_error, decode, handler) feed the metrics; ``relists`` and ``errors`` count the same.
    """

    def __init__(self, api_client: Any, handler: InformerHandler, *, watch_timeout_s: int = 60,
                 request_timeout_s: float = 30.0, page_size: int = 500,
                 pod_field_selector: str | None = DEFAULT_POD_FIELD_SELECTOR,
                 node_label_selector: str | None = None,
                 transform: Callable[[Kind, Obj], Any] | None = strip_managed_fields,
                 backoff: Callable[[], Backoff] = Backoff,
                 on_relist_metric: Callable[[Kind, str], None] | None = None,
                 on_error_metric: Callable[[Kind, str], None] | None = None,
                 budgets: bool = False) -> None:
        from kubernetes import client

        core = client.CoreV1Api(api_client)
        self.handler = handler
        self.watch_timeout_s = int(watch_timeout_s)
        self.request_timeout_s = request_timeout_s
        self.page_size = page_size
        self.min_watch_s = min(MIN_WATCH_S, self.watch_timeout_s / 2)  # a watch's own timeout is no fault
        self._transform_fn = transform
        self._backoff_factory = backoff
        self._on_relist_metric = on_relist_metric
        self._on_error_metric = on_error_metric
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._deliver = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._warn = RateLimitedLog(log)
        self._synced = threading.Event()
        self._relist_gen = 0
        pod_sel = {"field_selector": pod_field_selector} if pod_field_selector else {}
        node_sel = {"label_selector": node_label_selector} if node_label_selector else {}
        self._streams: dict[Kind, _Stream] = {
            "Node": _Stream(self, "Node", core.list_node, node_sel),
            "Pod": _Stream(self, "Pod", core.list_pod_for_all_namespaces, pod_sel),
        }
        if budgets:  # PodDisruptionBudgets (policy/v1), for preemption
            policy = client.PolicyV1Api(api_client)
            self._streams["PodDisruptionBudget"] = _Stream(
                self, "PodDisruptionBudget", policy.list_pod_disruption_budget_for_all_namespaces, {})
        self.relists: dict[Kind, int] = dict.fromkeys(self._streams, 0)
        self.errors: dict[Kind, int] = dict.fromkeys(self._streams, 0)

    # ---- lifecycle

    def start(self) -> None:
        for stream in self._streams.values():
            if stream.thread is None:
                stream.thread = threading.Thread(target=stream.run, name=f"informer-{stream.kind.lower()}",
                                                 daemon=True)
                stream.thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """End both loops: open watches are shut down, waits end at once. Idempotent."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for stream in self._streams.values():
            stream.abort()
        for stream in self._streams.values():
            if stream.thread is not None:
                stream.thread.join(timeout)

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    # ---- state

    @property
    def synced(self) -> bool:
        """True once every kind has been listed completely at least once."""
        return self._synced.is_set()

    def wait_synced(self, timeout: float | None = None) -> bool:
        return self._synced.wait(timeout)

    def resource_version(self, kind: Kind) -> str:
        return self._streams[kind].rv

    def request_relist(self) -> int:
        """List both kinds afresh (e.g. on a leadership change); returns a ticket for :meth:`relisted`."""
        with self._lock:
            self._relist_gen += 1
            gen = self._relist_gen
            for stream in self._streams.values():
                stream.force_relist = True
        for stream in self._streams.values():
            stream.abort()
        return gen

    def relisted(self, ticket: int) -> bool:
        """Whether both kinds have been listed completely since :meth:`request_relist` gave ``ticket``."""
        with self._lock:
            return all(s.listed_gen >= ticket for s in self._streams.values())

    def wait_relisted(self, ticket: int, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._stop.is_set() or all(
                s.listed_gen >= ticket for s in self._streams.values()), timeout) and not self._stop.is_set()

    # ---- internals used by the streams

    def _transform(self, kind: Kind, obj: Obj) -> Any:
        return self._transform_fn(kind, obj) if self._transform_fn is not None else obj

    def _deliver_relist(self, kind: Kind, items: list[Any]) -> None:
        with self._deliver:
            try:
                self.handler.on_relist(kind, items)
            except Exception:
                self._count_error(kind, "handler")
                log.exception("the informer handler failed on a %s relist", kind)

    def _deliver_event(self, kind: Kind, type_: EventType, obj: Any) -> None:
        with self._deliver:
            try:
                self.handler.on_event(kind, type_, obj)
            except Exception:
                self._count_error(kind, "handler")
                self._warn.log(logging.ERROR, f"{kind}-handler", "the informer handler failed on a %s %s event",
                               kind, type_, exc_info=True)

    def _after_list(self, stream: _Stream, reason: str) -> None:
        with self._cond:
            self.relists[stream.kind] += 1
            if all(s.lists > 0 for s in self._streams.values()):
                self._synced.set()
            self._cond.notify_all()
        self._warn.reset(f"{stream.kind}-error")
        if self._on_relist_metric is not None:
            self._on_relist_metric(stream.kind, reason)

    def _count_error(self, kind: Kind, code: str) -> None:
        with self._lock:
            self.errors[kind] += 1
        if self._on_error_metric is not None:
            self._on_error_metric(kind, code)
