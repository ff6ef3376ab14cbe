"""gpu-slice's pure core: the slice model, placement, packing policies and the part contract.

The names below are the stable surface the services build on; everything else is reachable by
module but may change between minor versions. Start with :mod:`gpuslice.scheduler`: the decision
API (``Scheduler``, ``ClusterView``) that the extender and the simulator both call. Those are loaded
on first use, so importing the model alone stays cheap.
"""

from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from gpuslice.scheduler import BindPlan, FilterResult, PackedCluster, Scheduler
    from gpuslice.view import ClusterView

_LAZY = {"BindPlan": "gpuslice.scheduler", "FilterResult": "gpuslice.scheduler",
         "PackedCluster": "gpuslice.scheduler", "Scheduler": "gpuslice.scheduler", "ClusterView": "gpuslice.view"}


def __getattr__(name: str) -> Any:
    """The decision API, imported when first asked for (PEP 562)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gpuslice' has no attribute {name!r}")


__all__ = [
    "RESOURCE",
    "AnnotationError",
    "BindPlan",
    "CatalogueError",
    "ClusterView",
    "ConfigError",
    "DeviceIdError",
    "Feasibility",
    "FilterResult",
    "Gpu",
    "GpuMode",
    "GpuSliceError",
    "InventoryError",
    "MigInstance",
    "NodeInventory",
    "PackedCluster",
    "Placement",
    "PolicyError",
    "RequestError",
    "Scheduler",
    "SliceRequest",
    "enumerate_placements",
    "parse_request",
]
