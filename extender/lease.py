"""Fencing input: is the kube-scheduler next to this extender the leader right now?

Replicas of the scheduler pod give availability through kube-scheduler's leader election (a
coordination.k8s.io/v1 Lease, by default ``kube-system/gpu-slice-scheduler``). Only the leader's
extender may write assignments and Bindings, so ``/bind`` asks :meth:`Fence.check` first (DESIGN 4).

kube-scheduler's identity is ``<hostname>_<uuid>``; the sidecar knows only its hostname (the pod
name), so the holder matches when it equals the identity or starts with ``identity + "_"``
(``sched-1`` does not match ``sched-10_…``: pod names cannot contain ``_``). The lease is held while
``renewTime + leaseDurationSeconds > now``; both clocks are this node's (the scheduler container
writes renewTime, this sidecar compares), so there is no cross-node skew to allow for.

A change of leader (holder identity or ``leaseTransitions``) is reported through ``on_change`` and
``generation`` so the app can go not-ready until its informer has listed afresh: a new leader must
not bind from a cache that missed what the old leader did.

Reads fail closed: when the Lease cannot be read, the last record read is used, and it stops holding
once its renewTime + duration passes. A missing Lease holds for nobody; a scheduler run without
leader election (one replica) is deployed with ``--no-fencing`` (:meth:`Fence.disabled`).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from extender.errors import KubeApiError
from extender.logs import RateLimitedLog

log = logging.getLogger(__name__)

Obj = dict[str, Any]
DEFAULT_NAMESPACE = "kube-system"
DEFAULT_NAME = "gpu-slice-scheduler"


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _time(value: object) -> datetime | None:
    """A Lease MicroTime (``2025-01-01T00:00:00.000000Z``) as an aware datetime, None if unreadable."""
    if not isinstance(value, str) or len(value) > 64:
        return None
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        return None
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when


def identity_matches(holder: str | None, identity: str) -> bool:
    """Whether the Lease's ``holderIdentity`` names the scheduler whose hostname is ``identity``."""
    if not holder or not identity:
        return False
    return holder == identity or holder.startswith(identity + "_")


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """What fencing needs from a Lease; fields the Lease lacks or garbles are None."""

    holder: str | None
    renew_time: datetime | None
    duration_s: int | None
    transitions: int
    resource_version: str = ""

    @property
    def expires_at(self) -> datetime | None:
        if self.renew_time is None or self.duration_s is None:
            return None
        return self.renew_time + timedelta(seconds=self.duration_s)

    def fresh(self, now: datetime) -> bool:
        expires = self.expires_at
        return expires is not None and expires > now

    def holds(self, identity: str, now: datetime) -> bool:
        """True only when the holder is ``identity`` (or ``identity_<uuid>``) and the Lease is fresh."""
        return identity_matches(self.holder, identity) and self.fresh(now)

    @property
    def term(self) -> tuple[str | None, int]:
        """What identifies one leadership: a renewal keeps it, a new holder or transition changes it."""
        return (self.holder, self.transitions)


def parse_lease(obj: object) -> LeaseRecord:
    """A Lease dict as the API server serves it; never raises (odd values read as missing)."""
    lease = obj if isinstance(obj, dict) else {}
    spec = lease.get("spec")
    spec = spec if isinstance(spec, dict) else {}
    meta = lease.get("metadata")
    meta = meta if isinstance(meta, dict) else {}
    holder = spec.get("holderIdentity")
    duration = spec.get("leaseDurationSeconds")
    transitions = spec.get("leaseTransitions")
    return LeaseRecord(
        holder=holder if isinstance(holder, str) and holder else None,
        renew_time=_time(spec.get("renewTime")),
        duration_s=duration if isinstance(duration, int) and not isinstance(duration, bool) and duration > 0
        else None,
        transitions=transitions if isinstance(transitions, int) and not isinstance(transitions, bool) else 0,
        resource_version=str(meta.get("resourceVersion") or ""),
    )


def holds(lease: LeaseRecord | Obj | None, identity: str, now: datetime) -> bool:
    """``lease`` (a record, a Lease dict or None for no Lease) is held by ``identity`` at ``now``."""
    if lease is None:
        return False
    record = lease if isinstance(lease, LeaseRecord) else parse_lease(lease)
    return record.holds(identity, now)


class Fence:
    """Reads the scheduler's Lease and answers whether this replica may bind.

    ``check()`` (at /bind) reads the Lease unless the last read is younger than ``max_age_s``;
    ``start()`` polls every ``interval_s`` so a change of leader is noticed without binds.
    ``on_change(old, new)`` runs on the thread that noticed the change; ``errors`` counts failed reads.
    """

    def __init__(self, api_client: Any | None, identity: str, *, namespace: str = DEFAULT_NAMESPACE,
                 name: str = DEFAULT_NAME, enabled: bool = True, timeout_s: float = 2.0,
                 clock: Callable[[], datetime] = _utcnow,
                 on_change: Callable[[LeaseRecord | None, LeaseRecord | None], None] | None = None,
                 on_error: Callable[[], None] | None = None) -> None:
        if enabled and api_client is None:
            raise ValueError("fencing needs a Kubernetes API client (or enabled=False for --no-fencing)")
        if enabled and not identity:
            raise ValueError("fencing needs this scheduler's identity (its pod name / hostname)")
        self.identity = identity
        self.namespace = namespace
        self.name = name
        self.enabled = enabled
        self.timeout_s = timeout_s
        self._clock = clock
        self._on_change = on_change
        self._on_error = on_error
        self._api: Any = None
        if enabled:
            from kubernetes import client

            self._api = client.CoordinationV1Api(api_client)
        self._lock = threading.Lock()
        self._record: LeaseRecord | None = None
        self._observed = False
        self._read_at: datetime | None = None
        self._warn = RateLimitedLog(log)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.generation = 0
        self.errors = 0

    @classmethod
    def disabled(cls, identity: str = "") -> Fence:
        """``--no-fencing``: always holds, never reads (one scheduler replica without leader election)."""
        return cls(None, identity, enabled=False)

    # ---- reading

    def read(self) -> LeaseRecord | None:
        """The Lease as it is now, None when it does not exist; ``KubeApiError`` when it cannot be read."""
        try:
            resp = self._api.read_namespaced_lease(self.name, self.namespace, _preload_content=False,
                                                   _request_timeout=self.timeout_s)
        except Exception as exc:
            status = getattr(exc, "status", None)
            if status == 404:
                return None
            code = status if isinstance(status, int) and status > 0 else None
            raise KubeApiError(f"read Lease {self.namespace}/{self.name}: "
                               f"{f'HTTP {code}' if code else type(exc).__name__}", code) from exc
        try:
            body = json.loads(resp.data)
        except ValueError as exc:
            raise KubeApiError(f"read Lease {self.namespace}/{self.name}: not JSON") from exc
        finally:
            resp.release_conn()
        return parse_lease(body)

    def refresh(self) -> bool:
        """Read the Lease and remember it; True when the leader changed since the previous read.

        A failed read keeps the previous record (which expires on its own) and returns False.
        """
        if not self.enabled:
            return False
        try:
            record = self.read()
        except KubeApiError as exc:
            with self._lock:
                self.errors += 1
            if self._on_error is not None:
                self._on_error()
            self._warn.warning("read", "cannot read the scheduler Lease (%s); fencing uses the last one read", exc)
            return False
        self._warn.reset("read")
        with self._lock:
            old, observed = self._record, self._observed
            self._record, self._observed, self._read_at = record, True, self._clock()
            changed = observed and _term(old) != _term(record)
            if changed:
                self.generation += 1
        if changed:
            log.info("scheduler leadership changed: %s -> %s", _term(old), _term(record))
            if self._on_change is not None:
                self._on_change(old, record)
        return changed

    # ---- answers

    @property
    def record(self) -> LeaseRecord | None:
        with self._lock:
            return self._record

    def holds(self, now: datetime | None = None) -> bool:
        """Whether this replica held the Lease at ``now`` by the last record read (no I/O)."""
        if not self.enabled:
            return True
        record = self.record
        return record is not None and record.holds(self.identity, now or self._clock())

    def check(self, max_age_s: float = 0.0) -> bool:
        """Fencing for /bind: read the Lease unless read less than ``max_age_s`` ago, then ``holds``."""
        if not self.enabled:
            return True
        with self._lock:
            read_at = self._read_at
        if read_at is None or (self._clock() - read_at).total_seconds() >= max_age_s:
            self.refresh()
        return self.holds()

    def check_recent(self, max_age_s: float) -> bool:
        """Fencing for /bind with fewer reads: a read younger than ``max_age_s`` that says this replica
        holds the Lease is trusted (its renew time + duration still decides); any other answer comes
        from a fresh read."""
        if not self.enabled:
            return True
        with self._lock:
            read_at = self._read_at
        if read_at is not None and (self._clock() - read_at).total_seconds() < max_age_s and self.holds():
            return True
        self.refresh()
        return self.holds()

    # ---- background polling

    def start(self, interval_s: float = 2.0) -> None:
        """Poll the Lease every ``interval_s`` on a daemon thread (first read at once)."""
        if not self.enabled or self._thread is not None:
            return

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.refresh()
                except Exception:  # an on_change callback failing must not end the polling
                    log.exception("fencing: a leadership-change callback failed")
                self._stop.wait(interval_s)

        self._thread = threading.Thread(target=loop, name="lease-fence", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)


def _term(record: LeaseRecord | None) -> tuple[str | None, int] | None:
    return None if record is None else record.term
