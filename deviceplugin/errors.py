"""The device plugin's typed errors, so callers translate them (gRPC status, exit code) by class.

    DevicePluginError
    ├── DiscoveryError   NVML could not be read, or a GPU it reports cannot be modelled
    ├── TopologyError    a simulated topology file (or call) that fails validation; names the field
    ├── MpsError         an MPS daemon that cannot be run, or a slice request MPS cannot serve
    ├── SettingsError    a flag or config value that stops start-up (names the field)
    ├── PlacementRefused device ids that form no valid placement (Allocate answers an error)
    ├── RegistrationError  serving the socket or registering with kubelet failed
    └── KubeApiError     a Kubernetes API call failed (KubeUnavailable: no configuration)

Other modules of the plugin may append classes here.
"""

from __future__ import annotations

from gpuslice.errors import GpuSliceError


class DevicePluginError(GpuSliceError):
    """Base of every error raised by ``deviceplugin``."""


class DiscoveryError(DevicePluginError):
    """GPU discovery failed (NVML missing, a call failed, a GPU that cannot be modelled)."""


class TopologyError(DevicePluginError):
    """A simulated topology that fails validation; the message names the offending field."""


class MpsError(DevicePluginError):
    """An MPS control daemon problem, or MPS client settings asked for something impossible."""


class SettingsError(DevicePluginError):
    """A flag or config value that stops start-up; the message names the field."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class PlacementRefused(DevicePluginError):
    """Device ids that form no valid placement on this node (answered as a gRPC error at Allocate)."""


class RegistrationError(DevicePluginError):
    """Serving the plugin socket or registering with kubelet failed."""


class KubeApiError(DevicePluginError):
    """A Kubernetes API call failed; chains the client library's exception."""


class KubeUnavailable(KubeApiError):
    """No Kubernetes API configuration was found (the plugin then runs without assignments)."""


class RecutRefused(DevicePluginError):
    """A MIG re-cut that would touch an instance in use, break the product's layout rules, or that this
    backend may not make (read-only, not MIG, opted out); nothing was changed."""


class RecutFailed(DevicePluginError):
    """A MIG re-cut that NVML stopped part-way; the message says what was done before the failure."""
