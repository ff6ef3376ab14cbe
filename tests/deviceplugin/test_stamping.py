"""The stamper against a PodResources server over a real unix socket, with a recording writer."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest

from deviceplugin._proto.podresources.v1 import api_pb2 as pr
from deviceplugin._proto.podresources.v1 import api_pb2_grpc as pr_grpc
from deviceplugin.assignments import AssignmentBook, PodView
from deviceplugin.errors import KubeApiError
from deviceplugin.stamping import PodResourcesClient, Stamper

RESOURCE = "example.com/gpu-slice"
NODE = "node-a"
A = ("GPU-aaaaaaaa-0000-0000-0000-000000000000::0", "GPU-aaaaaaaa-0000-0000-0000-000000000000::1")
B = ("GPU-aaaaaaaa-0000-0000-0000-000000000000::2", "GPU-aaaaaaaa-0000-0000-0000-000000000000::3")


class FakePodResources(pr_grpc.PodResourcesListerServicer):
    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], tuple[str, ...]] = {}
        self.calls = 0

    async def List(self, request: pr.ListPodResourcesRequest, context: Any) -> pr.ListPodResourcesResponse:
        self.calls += 1
        return pr.ListPodResourcesResponse(pod_resources=[
            pr.PodResources(namespace=ns, name=name, containers=[pr.ContainerResources(name="main", devices=[
                pr.ContainerDevices(resource_name=RESOURCE, device_ids=[i]) for i in ids] + [
                pr.ContainerDevices(resource_name="other.example/thing", device_ids=["x"])])])
            for (ns, name), ids in self.pods.items()])


class Writer:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str, dict[str, str]]] = []
        self.fail = 0

    def __call__(self, namespace: str, name: str, uid: str, annotations: Mapping[str, str]) -> object:
        if self.fail:
            self.fail -= 1
            raise KubeApiError("patch pod: 500 boom")
        self.calls.append((namespace, name, uid, dict(annotations)))
        return {}


class Metrics:
    def __init__(self) -> None:
        self.kinds: list[str] = []

    def allocation_mismatch(self, kind: str) -> None:
        self.kinds.append(kind)


@pytest.fixture
async def podres(sock_dir: Path) -> AsyncIterator[tuple[FakePodResources, PodResourcesClient]]:
    servicer = FakePodResources()
    server = grpc.aio.server()
    pr_grpc.add_PodResourcesListerServicer_to_server(servicer, server)
    path = sock_dir / "pr.sock"
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    client = PodResourcesClient(path)
    try:
        yield servicer, client
    finally:
        await client.close()
        await server.stop(0)


def view(name: str, ids: tuple[str, ...] | None, **kw: Any) -> PodView:
    return PodView("default", name, f"uid-{name}", NODE, "Pending", assignment_ids=ids, **kw)


async def test_stamps_newly_admitted_pods_with_kubelets_ids(
        podres: tuple[FakePodResources, PodResourcesClient]) -> None:
    server, client = podres
    book = AssignmentBook(NODE)
    book.upsert(view("p", A))
    writer = Writer()
    stamper = Stamper(book, client, RESOURCE, write=writer, backoff_s=0.01)
    server.pods[("default", "p")] = A
    result = await stamper.pass_once()
    assert result.stamped == 1 and result.mismatched == 0
    [(ns, name, uid, annotations)] = writer.calls
    assert (ns, name, uid) == ("default", "p", "uid-p")
    stamp = json.loads(annotations["example.com/gpu-slice.allocated"])
    assert stamp["v"] == 1 and sorted(stamp["sliceIds"]) == sorted(A) and stamp["time"].endswith("Z")
    assert book.pods["uid-p"].allocated_ids == tuple(sorted(A))
    assert (await stamper.pass_once()).stamped == 0  # written once


async def test_mismatch_is_counted_and_reported_once(podres: tuple[FakePodResources, PodResourcesClient]) -> None:
    server, client = podres
    book = AssignmentBook(NODE)
    book.upsert(view("p", A))
    events: list[tuple[str, ...]] = []

    async def event(*args: str) -> None:
        events.append(args)

    metrics = Metrics()
    writer = Writer()
    writer.fail = 1
    stamper = Stamper(book, client, RESOURCE, write=writer, event=event, metrics=metrics)
    server.pods[("default", "p")] = B
    first = await stamper.pass_once()
    assert first.failed == 1 and first.mismatched == 1
    second = await stamper.pass_once()
    assert second.stamped == 1
    assert metrics.kinds == ["stamp"] and stamper.mismatches == 1
    [(ns, name, uid, reason, message, type_)] = events
    assert (ns, name, uid, reason, type_) == ("default", "p", "uid-p", "SliceAssignmentMismatch", "Warning")
    assert B[0] in message and A[0] in message


async def test_bookkeeping_forgets_pods_that_are_gone(podres: tuple[FakePodResources, PodResourcesClient]) -> None:
    server, client = podres
    book = AssignmentBook(NODE)
    stamper = Stamper(book, client, RESOURCE, write=Writer(), metrics=Metrics())
    for n in range(20):
        book.upsert(view(f"p{n}", A))
        server.pods[("default", f"p{n}")] = B  # every pod mismatches once
        await stamper.pass_once()
        book.remove(f"uid-p{n}")
        del server.pods[("default", f"p{n}")]
    await stamper.pass_once()
    assert stamper.mismatches == 20
    assert not stamper._reported and not stamper._stamped


async def test_nudge_retries_until_the_pod_shows_up(podres: tuple[FakePodResources, PodResourcesClient]) -> None:
    server, client = podres
    book = AssignmentBook(NODE)
    book.upsert(view("late", A))
    writer = Writer()
    stamper = Stamper(book, client, RESOURCE, write=writer, backoff_s=0.01, retries=20, resync_s=60)
    stop = asyncio.Event()
    task = asyncio.create_task(stamper.run(stop))
    stamper.nudge()
    async with asyncio.timeout(5):
        while server.calls < 3:
            await asyncio.sleep(0.005)
    server.pods[("default", "late")] = A  # kubelet records the devices a little after Allocate
    async with asyncio.timeout(5):
        while not writer.calls:
            await asyncio.sleep(0.005)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert writer.calls[0][1] == "late"


async def test_pod_missing_from_the_cache_is_stamped_once_it_arrives(
        podres: tuple[FakePodResources, PodResourcesClient]) -> None:
    server, client = podres
    book = AssignmentBook(NODE)
    writer = Writer()
    stamper = Stamper(book, client, RESOURCE, write=writer)
    server.pods[("default", "p")] = A
    assert (await stamper.pass_once()).missing == 1
    book.upsert(view("p", None))  # a pod of another scheduler: no assignment, still stamped
    result = await stamper.pass_once()
    assert result.stamped == 1 and result.mismatched == 0
