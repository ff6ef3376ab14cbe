"""A kubelet stand-in (Registration, device choice, PodResources) for device plugin tests."""

from .standin import (
    AdmissionError,
    AdmissionResult,
    Container,
    ContainerResult,
    DeviceState,
    KubeletStandin,
    Pod,
    PreferredCall,
    Registration,
    is_extended_resource_name,
    slice_pod,
)

__all__ = [
    "AdmissionError",
    "AdmissionResult",
    "Container",
    "ContainerResult",
    "DeviceState",
    "KubeletStandin",
    "Pod",
    "PreferredCall",
    "Registration",
    "is_extended_resource_name",
    "slice_pod",
]
