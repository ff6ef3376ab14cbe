"""The informer against the fake API server, through the real ``kubernetes`` client over HTTP."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from extender.informer import Backoff, EventType, Informer, Kind
from tests.extender.helpers import WAIT, wait_for
from tests.fakeapi import FakeApiServer


def key(obj: dict[str, Any]) -> str:
    meta = obj["metadata"]
    return f"{meta['namespace']}/{meta['name']}" if meta.get("namespace") else meta["name"]


class Recorder:
    """A handler that keeps the state a real one would, and checks calls never overlap."""

    def __init__(self, fail_on: Callable[[str, str], bool] | None = None) -> None:
        self.cond = threading.Condition()
        self.state: dict[str, dict[str, dict[str, Any]]] = {"Node": {}, "Pod": {}}
        self.events: list[tuple[str, str, str]] = []
        self.relists: list[tuple[str, list[str]]] = []
        self.inside = False
        self.overlaps = 0
        self.fail_on = fail_on

    def _enter(self) -> None:
        if self.inside:
            self.overlaps += 1
        self.inside = True

    def on_event(self, kind: Kind, type: EventType, obj: dict[str, Any]) -> None:
        self._enter()
        try:
            with self.cond:
                self.events.append((kind, type, key(obj)))
                if self.fail_on is not None and self.fail_on(type, key(obj)):
                    raise RuntimeError("handler bug")
                if type == "DELETED":
                    self.state[kind].pop(key(obj), None)
                else:
                    self.state[kind][key(obj)] = obj
                self.cond.notify_all()
        finally:
            self.inside = False

    def on_relist(self, kind: Kind, objs: list[dict[str, Any]]) -> None:
        self._enter()
        try:
            with self.cond:
                self.relists.append((kind, sorted(key(o) for o in objs)))
                self.state[kind] = {key(o): o for o in objs}
                self.cond.notify_all()
        finally:
            self.inside = False

    def wait(self, predicate: Callable[[Recorder], bool], timeout: float = WAIT) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: predicate(self), timeout)

    def names(self, kind: str) -> set[str]:
        with self.cond:
            return set(self.state[kind])


def pod(name: str, **extra: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ml"},
            "spec": {"containers": [{"name": "main", "image": "x"}]}, **extra}


class RecordingBackoff(Backoff):
    """The real backoff with tiny steps, remembering every wait it handed out."""

    waits: list[float]

    def __init__(self) -> None:
        super().__init__(initial=0.01, maximum=0.05, rng=random.Random(1))
        self.waits = []

    def next(self) -> float:
        delay = super().next()
        self.waits.append(delay)
        return delay


@pytest.fixture
def api(fake_api: FakeApiServer) -> FakeApiServer:
    fake_api.store.put_node({"metadata": {"name": "n1", "managedFields": [{"manager": "kubelet"}]}})
    fake_api.store.put_node({"metadata": {"name": "n2"}})
    fake_api.store.put_pod(pod("p1"))
    fake_api.store.put_pod(pod("done", status={"phase": "Succeeded"}))
    return fake_api


@pytest.fixture
def make(api: FakeApiServer) -> Iterator[Callable[..., tuple[Informer, Recorder]]]:
    made: list[Informer] = []

    def build(recorder: Recorder | None = None, **kwargs: Any) -> tuple[Informer, Recorder]:
        rec = recorder or Recorder()
        kwargs.setdefault("watch_timeout_s", 30)
        kwargs.setdefault("request_timeout_s", 5.0)
        inf = Informer(api.client(retries=False), rec, **kwargs)
        made.append(inf)
        return inf, rec

    yield build
    for inf in made:
        inf.stop()


def test_initial_sync_lists_both_kinds(api: FakeApiServer, make: Callable[..., tuple[Informer, Recorder]]) -> None:
    relisted: list[tuple[str, str]] = []
    inf, rec = make(on_relist_metric=lambda k, r: relisted.append((k, r)))
    assert not inf.synced
    inf.start()
    assert inf.wait_synced(WAIT)
    assert rec.names("Node") == {"n1", "n2"}
    assert rec.names("Pod") == {"ml/p1"}  # the finished pod is not listed
    assert sorted(relisted) == [("Node", "initial"), ("Pod", "initial")]
    assert inf.relists == {"Node": 1, "Pod": 1}
    assert inf.errors == {"Node": 0, "Pod": 0}
    assert inf.resource_version("Node") == str(api.store.resource_version)
    assert "managedFields" not in rec.state["Node"]["n1"]["metadata"]


def test_changes_are_delivered_in_order(api: FakeApiServer, make: Callable[..., tuple[Informer, Recorder]]) -> None:
    inf, rec = make()
    inf.start()
    assert inf.wait_synced(WAIT)
    api.store.put_node({"metadata": {"name": "n3"}})
    api.store.update_node("n1", lambda n: n["metadata"].setdefault("labels", {}).update(zone="b"))
    api.store.remove("nodes", "n2")
    api.store.put_pod(pod("p2"))
    api.store.set_pod_phase("p1", "Succeeded", namespace="ml")  # leaves the selection: DELETED
    assert rec.wait(lambda r: len(r.events) == 5)
    assert [e for e in rec.events if e[0] == "Node"] == [
        ("Node", "ADDED", "n3"), ("Node", "MODIFIED", "n1"), ("Node", "DELETED", "n2")]
    assert [e for e in rec.events if e[0] == "Pod"] == [("Pod", "ADDED", "ml/p2"), ("Pod", "DELETED", "ml/p1")]
    assert rec.names("Node") == {"n1", "n3"}
    assert rec.state["Node"]["n1"]["metadata"]["labels"] == {"zone": "b"}
    assert rec.names("Pod") == {"ml/p2"}
    assert rec.overlaps == 0
    assert wait_for(lambda: inf.resource_version("Pod") == str(api.store.resource_version))


def test_all_pods_when_asked(api: FakeApiServer, make: Callable[..., tuple[Informer, Recorder]]) -> None:
    inf, rec = make(pod_field_selector=None)
    inf.start()
    assert inf.wait_synced(WAIT)
    assert rec.names("Pod") == {"ml/p1", "ml/done"}


def test_lists_in_pages(api: FakeApiServer, make: Callable[..., tuple[Informer, Recorder]]) -> None:
    for i in range(3, 8):
        api.store.put_node({"metadata": {"name": f"n{i}"}})
    inf, rec = make(page_size=2)
    inf.start()
    assert inf.wait_synced(WAIT)
    assert ("Node", [f"n{i}" for i in range(1, 8)]) in rec.relists
    assert api.request_count("list", "/api/v1/nodes") == 4


def test_bookmarks_advance_the_resource_version_only(api: FakeApiServer,
                                                      make: Callable[..., tuple[Informer, Recorder]]) -> None:
    inf, rec = make(watch_timeout_s=1)
    inf.start()
    assert inf.wait_synced(WAIT)
    # Writes to another resource move the global version; only a bookmark can tell the pod watch.
    api.store.put_lease({"metadata": {"name": "l", "namespace": "kube-system"}})
    target = str(api.store.resource_version)
    assert wait_for(lambda: inf.resource_version("Pod") == target)
    assert rec.events == []
    assert inf.relists == {"Node": 1, "Pod": 1}
    watches = [r for r in api.requests if r.verb == "watch"]
    assert all(r.query.get("allowWatchBookmarks") == "true" for r in watches)


def _deleted_while_no_watch_is_open(api: FakeApiServer, rec: Recorder, inf: Informer, fault: Any,
                                    compact: bool) -> None:
    """Delete p1 while the next pod watch is held at the server, then check the relist drops it."""
    assert wait_for(lambda: fault.hits == 1)  # the old watch has ended; the new one waits in the fault
    api.store.remove("pods", "p1", "ml")
    api.store.put_pod(pod("p3"))
    if compact:
        api.store.compact()
    assert rec.wait(lambda r: ("Pod", ["ml/p3"]) in r.relists)
    assert rec.names("Pod") == {"ml/p3"}
    assert ("Pod", "DELETED", "ml/p1") not in rec.events  # dropped by the relist, not by an event
    assert inf.relists["Pod"] == 2
    if not compact:
        assert inf.relists["Node"] == 1  # (compaction expires the node watch's version too)


def test_watch_error_event_410_relists(api: FakeApiServer, make: Callable[..., tuple[Informer, Recorder]]) -> None:
    reasons: list[tuple[str, str]] = []
    inf, rec = make(watch_timeout_s=1, on_relist_metric=lambda k, r: reasons.append((k, r)))
    inf.start()
    assert inf.wait_synced(WAIT)
    fault = api.hang_next("watch", "/api/v1/pods", seconds=1.0)
    _deleted_while_no_watch_is_open(api, rec, inf, fault, compact=True)
    assert ("Pod", "gone") in reasons
    assert inf.errors["Pod"] == 0  # expiry is routine, not an error


def test_http_410_on_the_watch_relists(api: FakeApiServer, make: Callable[..., tuple[Informer, Recorder]]) -> None:
    inf, rec = make(watch_timeout_s=1)
    inf.start()
    assert inf.wait_synced(WAIT)
    fault = api.inject("watch", "/api/v1/pods", code=410, delay=1.0)
    _deleted_while_no_watch_is_open(api, rec, inf, fault, compact=False)


def test_api_errors_back_off_and_recover(api: FakeApiServer, make: Callable[..., tuple[Informer, Recorder]]) -> None:
    backoffs: list[RecordingBackoff] = []

    def factory() -> Backoff:
        backoffs.append(RecordingBackoff())
        return backoffs[-1]

    codes: list[tuple[str, str]] = []
    api.fail_next("list", "/api/v1/nodes", code=500, times=3)
    inf, rec = make(backoff=factory, on_error_metric=lambda k, c: codes.append((k, c)))
    inf.start()
    assert inf.wait_synced(WAIT)
    assert rec.names("Node") == {"n1", "n2"}
    assert inf.errors == {"Node": 3, "Pod": 0}
    assert codes == [("Node", "http_5xx")] * 3
    node_backoff = next(b for b in backoffs if b.waits)
    assert len(node_backoff.waits) == 3
    assert node_backoff.attempts == 0  # reset by the successful list
    assert api.request_count("list", "/api/v1/nodes") == 4


def test_a_dropped_watch_resumes_without_relisting(api: FakeApiServer,
                                                   make: Callable[..., tuple[Informer, Recorder]]) -> None:
    codes: list[tuple[str, str]] = []
    inf, rec = make(watch_timeout_s=1, backoff=RecordingBackoff,
                    on_error_metric=lambda k, c: codes.append((k, c)))
    inf.start()
    assert inf.wait_synced(WAIT)
    fault = api.inject("watch", "/api/v1/nodes", drop=True)
    assert wait_for(lambda: fault.hits == 1)
    api.store.put_node({"metadata": {"name": "n9"}})
    assert rec.wait(lambda r: "n9" in r.state["Node"])
    assert ("Node", "ADDED", "n9") in rec.events
    assert inf.relists == {"Node": 1, "Pod": 1}
    assert codes == [("Node", "transport")]


def test_a_watch_error_event_resumes_from_the_last_version(api: FakeApiServer,
                                                           make: Callable[..., tuple[Informer, Recorder]]) -> None:
    inf, rec = make(watch_timeout_s=1, backoff=RecordingBackoff)
    inf.start()
    assert inf.wait_synced(WAIT)
    api.fail_next("watch", "/api/v1/nodes", code=500)
    assert wait_for(lambda: inf.errors["Node"] == 1)
    api.store.put_node({"metadata": {"name": "n9"}})
    assert rec.wait(lambda r: "n9" in r.state["Node"])
    assert inf.relists == {"Node": 1, "Pod": 1}


def test_handler_failures_are_counted_and_do_not_stop_the_informer(
        api: FakeApiServer, make: Callable[..., tuple[Informer, Recorder]]) -> None:
    codes: list[tuple[str, str]] = []
    inf, rec = make(Recorder(fail_on=lambda t, k: k == "bad"), on_error_metric=lambda k, c: codes.append((k, c)))
    inf.start()
    assert inf.wait_synced(WAIT)
    api.store.put_node({"metadata": {"name": "bad"}})
    api.store.put_node({"metadata": {"name": "good"}})
    assert rec.wait(lambda r: "good" in r.state["Node"])
    assert codes == [("Node", "handler")]


def test_requested_relist_lists_both_kinds_again(api: FakeApiServer,
                                                 make: Callable[..., tuple[Informer, Recorder]]) -> None:
    reasons: list[tuple[str, str]] = []
    inf, rec = make(on_relist_metric=lambda k, r: reasons.append((k, r)))
    inf.start()
    assert inf.wait_synced(WAIT)
    ticket = inf.request_relist()
    assert inf.wait_relisted(ticket, WAIT)
    assert inf.relisted(ticket)
    assert not inf.relisted(ticket + 1)
    assert inf.relists == {"Node": 2, "Pod": 2}
    assert sorted(r for r in reasons if r[1] == "requested") == [("Node", "requested"), ("Pod", "requested")]
    api.store.put_node({"metadata": {"name": "n9"}})  # and it watches again afterwards
    assert rec.wait(lambda r: "n9" in r.state["Node"])


def test_stop_is_prompt_with_a_long_watch_open(api: FakeApiServer,
                                               make: Callable[..., tuple[Informer, Recorder]]) -> None:
    inf, _ = make(watch_timeout_s=300)
    inf.start()
    assert inf.wait_synced(WAIT)
    assert wait_for(lambda: api.request_count("watch") >= 2)
    threads = [t for t in threading.enumerate() if t.name.startswith("informer-")]
    assert len(threads) == 2
    inf.stop(timeout=2.0)
    assert inf.stopped
    assert not any(t.is_alive() for t in threads)


def test_stop_during_backoff_is_prompt(api: FakeApiServer, make: Callable[..., tuple[Informer, Recorder]]) -> None:
    api.fail_next("list", "/api/v1/nodes", code=503, times=100)
    inf, _ = make(backoff=lambda: Backoff(initial=60.0, maximum=60.0))
    inf.start()
    assert wait_for(lambda: inf.errors["Node"] >= 1)
    threads = [t for t in threading.enumerate() if t.name.startswith("informer-")]
    inf.stop(timeout=2.0)
    assert not any(t.is_alive() for t in threads)
    assert not inf.synced


def test_backoff_grows_is_bounded_and_resets() -> None:
    b = Backoff(initial=1.0, maximum=8.0, factor=2.0, jitter=0.25, rng=random.Random(3))
    waits = [b.next() for _ in range(10)]
    assert 0.75 <= waits[0] <= 1.25
    assert 1.5 <= waits[1] <= 2.5
    assert all(0 <= w <= 8.0 for w in waits)
    assert waits[-1] >= 6.0  # at the cap, less jitter
    b.reset()
    assert b.next() <= 1.25
    no_jitter = Backoff(initial=0.5, maximum=3.0, jitter=0.0)
    assert [no_jitter.next() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_a_watch_closed_at_once_without_events_is_not_reopened_in_a_hot_loop(
        api: FakeApiServer, make: Callable[..., tuple[Informer, Recorder]]) -> None:
    """A proxy (or an API server under load) ending every watch at once: back off between watches,
    as client-go's reflector does for a "very short watch"."""
    codes: list[tuple[str, str]] = []
    backoff = RecordingBackoff()
    inf, _rec = make(backoff=lambda: backoff, on_error_metric=lambda k, c: codes.append((k, c)))
    api.max_watch_seconds = 0.0
    inf.start()
    assert inf.wait_synced(WAIT)
    assert wait_for(lambda: len(backoff.waits) >= 4)
    assert ("Pod", "short_watch") in codes and ("Node", "short_watch") in codes
    # Each closed watch waited its backoff before the next; nothing was relisted for it.
    watches = api.request_count("watch", "/api/v1/pods")
    assert watches <= sum(1 for k, c in codes if k == "Pod" and c == "short_watch") + 1
    assert inf.relists == {"Node": 1, "Pod": 1}
    # A watch that delivers something is a normal one.
    api.max_watch_seconds = 30.0
    codes.clear()
    api.store.put_pod(pod("p2"))
    assert wait_for(lambda: "ml/p2" in _rec.names("Pod"))
