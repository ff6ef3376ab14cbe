# Checked in; regenerate with scripts/gen_protos.py (grpcio-tools 1.85.1).
"""Typed view of api_pb2_grpc.py (written by scripts/gen_protos.py from deviceplugin/v1beta1/api.proto)."""

import collections.abc
import typing

import grpc
import grpc.aio

from . import api_pb2 as _pb2

GRPC_GENERATED_VERSION: str
GRPC_VERSION: str

class _ServicerContext(grpc.ServicerContext, grpc.aio.ServicerContext):  # type: ignore[misc, type-arg]
    """Either context, so servicers may be written for grpc or for grpc.aio."""

class RegistrationStub:
    @typing.overload
    def __new__(cls, channel: grpc.Channel) -> RegistrationStub: ...
    @typing.overload
    def __new__(cls, channel: grpc.aio.Channel) -> RegistrationAsyncStub: ...
    Register: grpc.UnaryUnaryMultiCallable[_pb2.RegisterRequest, _pb2.Empty]

class RegistrationAsyncStub:
    """Typing only: what RegistrationStub is over a grpc.aio channel."""
    Register: grpc.aio.UnaryUnaryMultiCallable[_pb2.RegisterRequest, _pb2.Empty]

class RegistrationServicer:
    def Register(self, request: _pb2.RegisterRequest, context: _ServicerContext) -> _pb2.Empty | collections.abc.Awaitable[_pb2.Empty]: ...

def add_RegistrationServicer_to_server(
    servicer: RegistrationServicer, server: grpc.Server | grpc.aio.Server
) -> None: ...

class DevicePluginStub:
    @typing.overload
    def __new__(cls, channel: grpc.Channel) -> DevicePluginStub: ...
    @typing.overload
    def __new__(cls, channel: grpc.aio.Channel) -> DevicePluginAsyncStub: ...
    GetDevicePluginOptions: grpc.UnaryUnaryMultiCallable[_pb2.Empty, _pb2.DevicePluginOptions]
    ListAndWatch: grpc.UnaryStreamMultiCallable[_pb2.Empty, _pb2.ListAndWatchResponse]
    GetPreferredAllocation: grpc.UnaryUnaryMultiCallable[_pb2.PreferredAllocationRequest, _pb2.PreferredAllocationResponse]
    Allocate: grpc.UnaryUnaryMultiCallable[_pb2.AllocateRequest, _pb2.AllocateResponse]
    PreStartContainer: grpc.UnaryUnaryMultiCallable[_pb2.PreStartContainerRequest, _pb2.PreStartContainerResponse]

class DevicePluginAsyncStub:
    """Typing only: what DevicePluginStub is over a grpc.aio channel."""
    GetDevicePluginOptions: grpc.aio.UnaryUnaryMultiCallable[_pb2.Empty, _pb2.DevicePluginOptions]
    ListAndWatch: grpc.aio.UnaryStreamMultiCallable[_pb2.Empty, _pb2.ListAndWatchResponse]
    GetPreferredAllocation: grpc.aio.UnaryUnaryMultiCallable[_pb2.PreferredAllocationRequest, _pb2.PreferredAllocationResponse]
    Allocate: grpc.aio.UnaryUnaryMultiCallable[_pb2.AllocateRequest, _pb2.AllocateResponse]
    PreStartContainer: grpc.aio.UnaryUnaryMultiCallable[_pb2.PreStartContainerRequest, _pb2.PreStartContainerResponse]

class DevicePluginServicer:
    def GetDevicePluginOptions(self, request: _pb2.Empty, context: _ServicerContext) -> _pb2.DevicePluginOptions | collections.abc.Awaitable[_pb2.DevicePluginOptions]: ...
    def ListAndWatch(self, request: _pb2.Empty, context: _ServicerContext) -> collections.abc.Iterator[_pb2.ListAndWatchResponse] | collections.abc.AsyncIterator[_pb2.ListAndWatchResponse]: ...
    def GetPreferredAllocation(self, request: _pb2.PreferredAllocationRequest, context: _ServicerContext) -> _pb2.PreferredAllocationResponse | collections.abc.Awaitable[_pb2.PreferredAllocationResponse]: ...
    def Allocate(self, request: _pb2.AllocateRequest, context: _ServicerContext) -> _pb2.AllocateResponse | collections.abc.Awaitable[_pb2.AllocateResponse]: ...
    def PreStartContainer(self, request: _pb2.PreStartContainerRequest, context: _ServicerContext) -> _pb2.PreStartContainerResponse | collections.abc.Awaitable[_pb2.PreStartContainerResponse]: ...

def add_DevicePluginServicer_to_server(
    servicer: DevicePluginServicer, server: grpc.Server | grpc.aio.Server
) -> None: ...
