"""Fencing on the scheduler's Lease, read through the real client from the fake API server."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from extender.lease import DEFAULT_NAME, DEFAULT_NAMESPACE, Fence, LeaseRecord, holds, identity_matches, parse_lease
from tests.extender.helpers import wait_for
from tests.fakeapi import FakeApiServer

NOW = datetime(2025, 6, 1, 12, 0, 0, tzinfo=UTC)
ME = "gpu-slice-scheduler-7c9d-abcde"


SCHEDULER_ID = f"{ME}_0b8e2c1a-5d4f-4c3b-9a8e-7f6d5c4b3a21"  # kube-scheduler's <hostname>_<uuid>


def lease(holder: str | None = SCHEDULER_ID, *, renew: str = "2025-06-01T11:59:55.123456Z",
          duration: Any = 15, transitions: Any = 3) -> dict[str, Any]:
    """A Lease as kube-scheduler's leader election writes it."""
    spec: dict[str, Any] = {"leaseDurationSeconds": duration, "acquireTime": "2025-06-01T10:00:00.000000Z",
                            "renewTime": renew, "leaseTransitions": transitions}
    if holder is not None:
        spec["holderIdentity"] = holder
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": DEFAULT_NAME, "namespace": DEFAULT_NAMESPACE}, "spec": spec}


class Clock:
    def __init__(self, now: datetime = NOW) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


# ------------------------------------------------------------------------------------- pure


@pytest.mark.parametrize(("holder", "identity", "expected"), [
    (ME, ME, True),
    (f"{ME}_0b8e2c1a-5d4f-4c3b-9a8e-7f6d5c4b3a21", ME, True),  # kube-scheduler's form
    ("sched-10_0b8e2c1a", "sched-1", False),
    ("sched-1", "sched-10", False),
    ("other_" + ME, ME, False),
    ("", ME, False),
    (None, ME, False),
    (ME, "", False),
])
def test_identity_matches(holder: str | None, identity: str, expected: bool) -> None:
    assert identity_matches(holder, identity) is expected


def test_a_fresh_lease_naming_us_holds() -> None:
    record = parse_lease(lease())
    assert record.holder == SCHEDULER_ID
    assert record.duration_s == 15 and record.transitions == 3
    assert record.expires_at == datetime(2025, 6, 1, 12, 0, 10, 123456, tzinfo=UTC)
    assert record.holds(ME, NOW)
    assert holds(lease(), ME, NOW)
    assert not record.holds("someone-else", NOW)


def test_an_expired_lease_does_not_hold() -> None:
    record = parse_lease(lease(renew="2025-06-01T11:59:45.000000Z"))
    assert not record.holds(ME, NOW)  # expires exactly now
    assert record.holds(ME, NOW - timedelta(microseconds=1))


@pytest.mark.parametrize("broken", [
    {"renew": "yesterday"}, {"renew": "2025-06-01"}, {"duration": "15"}, {"duration": 0}, {"duration": -5},
    {"duration": True}, {"duration": None}, {"holder": None}, {"holder": ""},
])
def test_a_lease_with_missing_or_odd_fields_holds_for_nobody(broken: dict[str, Any]) -> None:
    assert not holds(lease(**broken), ME, NOW)


@pytest.mark.parametrize("junk", [None, [], "lease", {"spec": []}, {"spec": {"renewTime": 5}}, {"metadata": 1}])
def test_parse_lease_never_raises(junk: Any) -> None:
    assert not holds(junk, ME, NOW)
    assert isinstance(parse_lease(junk), LeaseRecord)


# ------------------------------------------------------------------------------------- over the API


@pytest.fixture
def fence_for(fake_api: FakeApiServer) -> Any:
    fences: list[Fence] = []

    def build(**kwargs: Any) -> Fence:
        kwargs.setdefault("clock", Clock())
        fence = Fence(fake_api.client(retries=False), ME, **kwargs)
        fences.append(fence)
        return fence

    yield build
    for fence in fences:
        fence.stop()


def test_check_reads_the_lease(fake_api: FakeApiServer, fence_for: Any) -> None:
    fake_api.store.put_lease(lease())
    fence = fence_for()
    assert not fence.holds()  # nothing read yet
    assert fence.check()
    assert fence.record is not None and fence.record.transitions == 3
    assert fake_api.request_count("get", f"/apis/coordination.k8s.io/v1/namespaces/{DEFAULT_NAMESPACE}/leases/*") == 1


def test_another_holder_or_no_lease_means_no_binding(fake_api: FakeApiServer, fence_for: Any) -> None:
    fence = fence_for()
    assert not fence.check()  # 404: no Lease, no leader
    assert fence.errors == 0
    fake_api.store.put_lease(lease("gpu-slice-scheduler-7c9d-zzzzz_1234"))
    assert not fence.check()


def test_the_lease_expires_by_the_clock(fake_api: FakeApiServer, fence_for: Any) -> None:
    fake_api.store.put_lease(lease())
    clock = Clock()
    fence = fence_for(clock=clock)
    assert fence.check()
    clock.now = NOW + timedelta(seconds=11)
    assert not fence.holds()
    assert not fence.check()


def test_check_uses_a_recent_read(fake_api: FakeApiServer, fence_for: Any) -> None:
    fake_api.store.put_lease(lease())
    clock = Clock()
    fence = fence_for(clock=clock)
    assert fence.check(max_age_s=1.0) and fence.check(max_age_s=1.0)
    assert fake_api.request_count("get") == 1
    clock.now += timedelta(seconds=1)
    assert fence.check(max_age_s=1.0)
    assert fake_api.request_count("get") == 2


def test_check_recent_trusts_a_recent_yes_but_reads_again_after_a_no(fake_api: FakeApiServer,
                                                                   fence_for: Any) -> None:
    fake_api.store.put_lease(lease(holder="someone-else_1"))
    clock = Clock()
    fence = fence_for(clock=clock)
    assert not fence.check_recent(1.0)
    fake_api.store.put_lease(lease())  # now we lead: the next check reads again and sees it at once
    assert fence.check_recent(1.0)
    assert fake_api.request_count("get") == 2
    assert fence.check_recent(1.0)  # a yes younger than a second is trusted
    assert fake_api.request_count("get") == 2
    clock.now += timedelta(seconds=1)
    assert fence.check_recent(1.0)
    assert fake_api.request_count("get") == 3


def test_read_errors_fail_closed_on_the_last_record(fake_api: FakeApiServer, fence_for: Any) -> None:
    fake_api.store.put_lease(lease())
    clock = Clock()
    errors: list[int] = []
    fence = fence_for(clock=clock, on_error=lambda: errors.append(1))
    assert fence.check()
    fake_api.fail_next("get", "*/leases/*", code=500, times=10)
    assert fence.check()  # the last record is still fresh
    assert fence.errors == 1 and errors == [1]
    clock.now = NOW + timedelta(seconds=30)
    assert not fence.check()  # and it expires on its own


def test_leadership_changes_are_reported(fake_api: FakeApiServer, fence_for: Any) -> None:
    changes: list[tuple[Any, Any]] = []
    fence = fence_for(on_change=lambda old, new: changes.append((old and old.term, new and new.term)))
    fake_api.store.put_lease(lease("old-leader_1", transitions=3))
    assert not fence.refresh()  # the first read is no change
    fake_api.store.put_lease(lease("old-leader_1", transitions=3, renew="2025-06-01T11:59:58.000000Z"))
    assert not fence.refresh()  # a renewal is no change
    fake_api.store.put_lease(lease(f"{ME}_2", transitions=4))
    assert fence.refresh()
    assert fence.generation == 1
    fake_api.store.put_lease(lease(f"{ME}_3", transitions=4))  # same pod, restarted scheduler
    assert fence.refresh()
    fake_api.store.put_lease(lease(f"{ME}_3", transitions=5))  # lost and regained
    assert fence.refresh()
    fake_api.store.remove("leases", DEFAULT_NAME, DEFAULT_NAMESPACE)
    assert fence.refresh()
    assert fence.generation == 4
    assert changes == [(("old-leader_1", 3), (f"{ME}_2", 4)), ((f"{ME}_2", 4), (f"{ME}_3", 4)),
                       ((f"{ME}_3", 4), (f"{ME}_3", 5)), ((f"{ME}_3", 5), None)]


def test_lease_name_and_namespace_are_configurable(fake_api: FakeApiServer, fence_for: Any) -> None:
    other = lease()
    other["metadata"] = {"name": "my-lock", "namespace": "gpu"}
    fake_api.store.put_lease(other)
    assert fence_for(namespace="gpu", name="my-lock").check()
    assert not fence_for().check()


def test_no_fencing_always_holds(fake_api: FakeApiServer) -> None:
    fence = Fence.disabled(ME)
    assert fence.check() and fence.holds() and not fence.refresh()
    fence.start()
    fence.stop()
    assert fake_api.request_count() == 0


def test_fencing_needs_a_client_and_an_identity(fake_api: FakeApiServer) -> None:
    with pytest.raises(ValueError, match="client"):
        Fence(None, ME)
    with pytest.raises(ValueError, match="identity"):
        Fence(fake_api.client(), "")


def test_polling_notices_a_new_leader_and_stops_promptly(fake_api: FakeApiServer, fence_for: Any) -> None:
    changed = threading.Event()
    fake_api.store.put_lease(lease("old-leader_1"))
    fence = fence_for(on_change=lambda old, new: changed.set())
    fence.start(interval_s=0.05)
    assert wait_for(lambda: fake_api.request_count("get") >= 1)
    fake_api.store.put_lease(lease(f"{ME}_9", transitions=4))
    assert changed.wait(5)
    assert fence.holds()
    thread = next(t for t in threading.enumerate() if t.name == "lease-fence")
    fence.stop(timeout=2)
    assert not thread.is_alive()
