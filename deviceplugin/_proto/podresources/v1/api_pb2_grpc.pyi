# Checked in; regenerate with scripts/gen_protos.py (grpcio-tools 1.85.1).
"""Typed view of api_pb2_grpc.py (written by scripts/gen_protos.py from podresources/v1/api.proto)."""

import collections.abc
import typing

import grpc
import grpc.aio

from . import api_pb2 as _pb2

GRPC_GENERATED_VERSION: str
GRPC_VERSION: str

class _ServicerContext(grpc.ServicerContext, grpc.aio.ServicerContext):  # type: ignore[misc, type-arg]
    """Either context, so servicers may be written for grpc or for grpc.aio."""

class PodResourcesListerStub:
    @typing.overload
    def __new__(cls, channel: grpc.Channel) -> PodResourcesListerStub: ...
    @typing.overload
    def __new__(cls, channel: grpc.aio.Channel) -> PodResourcesListerAsyncStub: ...
    List: grpc.UnaryUnaryMultiCallable[_pb2.ListPodResourcesRequest, _pb2.ListPodResourcesResponse]
    GetAllocatableResources: grpc.UnaryUnaryMultiCallable[_pb2.AllocatableResourcesRequest, _pb2.AllocatableResourcesResponse]
    Get: grpc.UnaryUnaryMultiCallable[_pb2.GetPodResourcesRequest, _pb2.GetPodResourcesResponse]

class PodResourcesListerAsyncStub:
    """Typing only: what PodResourcesListerStub is over a grpc.aio channel."""
    List: grpc.aio.UnaryUnaryMultiCallable[_pb2.ListPodResourcesRequest, _pb2.ListPodResourcesResponse]
    GetAllocatableResources: grpc.aio.UnaryUnaryMultiCallable[_pb2.AllocatableResourcesRequest, _pb2.AllocatableResourcesResponse]
    Get: grpc.aio.UnaryUnaryMultiCallable[_pb2.GetPodResourcesRequest, _pb2.GetPodResourcesResponse]

class PodResourcesListerServicer:
    def List(self, request: _pb2.ListPodResourcesRequest, context: _ServicerContext) -> _pb2.ListPodResourcesResponse | collections.abc.Awaitable[_pb2.ListPodResourcesResponse]: ...
    def GetAllocatableResources(self, request: _pb2.AllocatableResourcesRequest, context: _ServicerContext) -> _pb2.AllocatableResourcesResponse | collections.abc.Awaitable[_pb2.AllocatableResourcesResponse]: ...
    def Get(self, request: _pb2.GetPodResourcesRequest, context: _ServicerContext) -> _pb2.GetPodResourcesResponse | collections.abc.Awaitable[_pb2.GetPodResourcesResponse]: ...

def add_PodResourcesListerServicer_to_server(
    servicer: PodResourcesListerServicer, server: grpc.Server | grpc.aio.Server
) -> None: ...
