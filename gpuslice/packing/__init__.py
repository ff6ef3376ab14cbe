"""Vectorised packing engine: array state of a cluster's GPU units and the candidates a pod has.

The services build a :class:`ClusterState` from live inventories; the simulator builds it from
trace files. Policies and :mod:`gpuslice.decision` only ever see this state, so both run the same
code.
"""

from gpuslice.packing.errors import PackingError, UnknownPolicyError, WeightError
from gpuslice.packing.state import (
    KIND_MIG,
    KIND_MPS,
    KIND_WHOLE,
    Candidates,
    ClusterState,
    NodeSpec,
    PackRequest,
    UnitSpec,
    enumerate_candidates,
)

__all__ = [
    "KIND_MIG",
    "KIND_MPS",
    "KIND_WHOLE",
    "Candidates",
    "ClusterState",
    "NodeSpec",
    "PackRequest",
    "PackingError",
    "UnitSpec",
    "UnknownPolicyError",
    "WeightError",
    "enumerate_candidates",
]
