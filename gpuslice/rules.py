"""The fit rules every part applies, each in one function: memory floor, MPS memory share,
isolation, and how a slice count maps onto GPUs.

The object model (:mod:`gpuslice.placement`, used by the device plugin and at bind), the array
state (:mod:`gpuslice.packing.state`, used by filter and the simulator) and the policies' target
workload (:mod:`gpuslice.packing.frag`) all call these, so a pod that one of them accepts is never
refused by another. The functions take scalars or numpy arrays alike.
"""

from __future__ import annotations

from typing import overload

import numpy as np
from numpy.typing import NDArray

from gpuslice.errors import RequestError

#: Relative tolerance of the memory floor (config ``memoryTolerance``): a ``20Gi`` request matches
#: 1g.20gb's 19.62 GiB. The config's default is this value.
DEFAULT_MEMORY_TOLERANCE = 0.03

def memory_floor_met(available_mib: object, floor_mib: object, tolerance: float) -> object:
    """``available >= floor * (1 - tolerance)``: the one memory test (vectorised over arrays)."""
    return np.asarray(available_mib, dtype=np.float64) >= np.asarray(floor_mib, dtype=np.float64) * (1.0 - tolerance)


def memory_fits(available_mib: float, floor_mib: float | None, tolerance: float) -> bool:
    """Scalar form of :func:`memory_floor_met`; no floor always fits."""
    if floor_mib is None:
        return True
    return bool(memory_floor_met(float(available_mib), float(floor_mib), tolerance))


#: Memory an MPS GPU keeps out of its shares before they are cut (DESIGN 5): the MPS server's own
#: context, and one client context per slice, so a k-slice pod may run k CUDA processes within its
#: share and a GPU whose pods all use their full shares still has room for every context. Client
#: contexts are counted for at most ``MAX_MPS_CLIENTS`` slices (no server takes more clients), so the
#: simulator's milli-GPU (S = 1000) keeps the same reserve as S = 48. Estimates from CUDA 12
#: contexts on H100-class GPUs; ``e2e/gpu_probe.py`` reads the real per-process memory on a node.
MPS_SERVER_RESERVE_MIB = 512
MPS_CONTEXT_RESERVE_MIB = 256
MAX_MPS_CLIENTS = 48


@overload
def mps_reserve_mib(per_gpu: int) -> int: ...
@overload
def mps_reserve_mib(per_gpu: NDArray[np.int64]) -> NDArray[np.int64]: ...
def mps_reserve_mib(per_gpu: int | NDArray[np.int64]) -> int | NDArray[np.int64]:
    """Memory kept for the MPS server and the client contexts of a GPU cut into ``per_gpu`` slices."""
    if isinstance(per_gpu, np.ndarray):
        return np.asarray(MPS_SERVER_RESERVE_MIB + np.minimum(per_gpu, MAX_MPS_CLIENTS) * MPS_CONTEXT_RESERVE_MIB,
                          dtype=np.int64)
    return MPS_SERVER_RESERVE_MIB + min(int(per_gpu), MAX_MPS_CLIENTS) * MPS_CONTEXT_RESERVE_MIB


@overload
def mps_share_mib(memory_mib: int, slices: int, per_gpu: int) -> int: ...
@overload
def mps_share_mib(memory_mib: NDArray[np.int64], slices: int | NDArray[np.int64],
                  per_gpu: int | NDArray[np.int64]) -> NDArray[np.int64]: ...
def mps_share_mib(memory_mib: int | NDArray[np.int64], slices: int | NDArray[np.int64],
                  per_gpu: int | NDArray[np.int64]) -> int | NDArray[np.int64]:
    """Memory a k-slice MPS share may use: k/S of what the GPU has after :func:`mps_reserve_mib`,
    floored to whole MiB (the packer's memory fit, the daemon's pinned-memory cap and the budget watch
    all read this)."""
    if isinstance(memory_mib, np.ndarray) or isinstance(per_gpu, np.ndarray):
        cuts = np.maximum(np.asarray(per_gpu, dtype=np.int64), 1)
        usable = np.maximum(np.asarray(memory_mib, dtype=np.int64) - mps_reserve_mib(cuts), 0)
        return np.asarray(usable * slices // cuts, dtype=np.int64)
    n = max(int(per_gpu), 1)
    return max(int(memory_mib) - mps_reserve_mib(n), 0) * int(slices) // n


def isolation_allows(mode: str, isolation: str) -> bool:
    """``mig`` and ``mps`` pin the GPU mode; ``any`` accepts every mode."""
    return isolation == "any" or mode == isolation


def gpus_for(slices: int, per_gpu: int) -> tuple[int, int]:
    """``(GPUs, slices per GPU)`` of a k-slice request: k <= S on one GPU, k = m*S as m whole GPUs."""
    if slices < 1:
        raise RequestError(f"a slice request needs at least 1 slice, got {slices}")
    if slices <= per_gpu:
        return 1, slices
    if slices % per_gpu:
        low = slices // per_gpu * per_gpu
        # The shipped admission policy (manifests/admission) refuses the same count in the same words.
        raise RequestError(f"{slices} slices is neither at most S={per_gpu} (one GPU) nor a whole number of "
                           f"GPUs (a multiple of {per_gpu}); did you mean {low} or {low + per_gpu}?")
    return slices // per_gpu, per_gpu
