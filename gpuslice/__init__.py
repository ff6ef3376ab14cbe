"""gpu-slice's pure core: the slice model, placement, packing policies and the part contract.

The names below are the stable surface the services build on; everything else is reachable by
module but may change between minor versions.
"""

from gpuslice.errors import (
    AnnotationError,
    CatalogueError,
    ConfigError,
    DeviceIdError,
    GpuSliceError,
    InventoryError,
    PolicyError,
    RequestError,
)
from gpuslice.model import Gpu, GpuMode, MigInstance, NodeInventory
from gpuslice.placement import Feasibility, Placement, enumerate_placements
from gpuslice.requests import RESOURCE, SliceRequest, parse_request

__all__ = [
    "RESOURCE",
    "AnnotationError",
    "CatalogueError",
    "ConfigError",
    "DeviceIdError",
    "Feasibility",
    "Gpu",
    "GpuMode",
    "GpuSliceError",
    "InventoryError",
    "MigInstance",
    "NodeInventory",
    "Placement",
    "PolicyError",
    "RequestError",
    "SliceRequest",
    "enumerate_placements",
    "parse_request",
]
