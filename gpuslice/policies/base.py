"""The policy protocol: score candidate placements in [0, 1], higher is better, vectorised.

A policy is a stateless object; whatever it learns (an online target distribution, caches, an RNG)
lives in the explicit ``memory`` value it creates with :meth:`Policy.new_memory` and that callers
pass back on every call, so the extender and the simulator hold it where they hold the state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from gpuslice.packing.state import Candidates, ClusterState, PackRequest

F64 = NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """What a policy may use to set up its memory: the seed, and (paper baselines only) the trace."""

    seed: int = 0
    trace: Sequence[PackRequest] | None = None


@runtime_checkable
class Policy(Protocol):
    """A packing policy. ``score`` is in [0, 1]; ``secondary`` orders placements it scores equally."""

    name: str

    def new_memory(self, ctx: PolicyContext) -> Any: ...

    def observe(self, memory: Any, req: PackRequest) -> None:
        """Learn from a pod that arrived (called once per pod, before scoring it)."""

    def memory_token(self, memory: Any) -> object:
        """What changes when ``memory`` changes other than by ``observe`` (live signals written into it
        from outside); a ranking computed at one token holds while the token and the state hold."""

    def score(self, state: ClusterState, req: PackRequest, cands: Candidates, memory: Any) -> F64: ...

    def secondary(self, state: ClusterState, req: PackRequest, cands: Candidates, memory: Any) -> F64: ...


class BasePolicy:
    """Defaults: no memory, no learning, no secondary order (the first unit of a node wins)."""

    name = "base"

    def new_memory(self, ctx: PolicyContext) -> Any:
        return None

    def observe(self, memory: Any, req: PackRequest) -> None:
        return None

    def memory_token(self, memory: Any) -> object:
        return None

    def score(self, state: ClusterState, req: PackRequest, cands: Candidates, memory: Any) -> F64:
        raise NotImplementedError

    def secondary(self, state: ClusterState, req: PackRequest, cands: Candidates, memory: Any) -> F64:
        return np.zeros(len(cands))


def unit_leftover(state: ClusterState, req: PackRequest, cands: Candidates) -> F64:
    """Free slices left on the chosen unit after placing (0 for multi-GPU and CPU-only pods)."""
    if req.gpus != 1:
        return np.zeros(len(cands))
    u = cands.units[:, 0]
    return (state.unit_free[u] - req.slices).astype(np.float64)


def node_slices_left(state: ClusterState, req: PackRequest, cands: Candidates) -> F64:
    """Free slices left on the candidate's node after placing."""
    return np.asarray(state.node_free_slices()[cands.node] - req.total_slices, dtype=np.float64)


def tightest(state: ClusterState, req: PackRequest, cands: Candidates) -> F64:
    """Secondary order for best-fit GPU choice inside a node: less leftover on the unit first."""
    return -unit_leftover(state, req, cands)
