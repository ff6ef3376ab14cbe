"""Where a GPU's real MIG layout differs from the static one the config says it carries
(``migLayouts.<product>.layout``, gpuslice/config.py).

gpu-slice never creates MIG instances on real GPUs: the GPU Operator's MIG manager (or mig-parted)
lays them out, and the plugin advertises what the GPU carries. A difference is worth one warning
naming the config field, so an operator sees that the node and the config disagree (a MIG manager
still applying its label, or a wrong label) instead of wondering why a profile never appears.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from gpuslice.config import Config
from gpuslice.model import Gpu


def layout_differences(config: Config, gpus: Iterable[Gpu]) -> Iterator[tuple[tuple[str, ...], str]]:
    """(key, warning) for each GPU whose layout differs; the key changes when the GPU's layout does,
    so a caller that warns once per key warns again after a change, never on every rediscovery."""
    for gpu in gpus:
        want = config.mig_layout_for(gpu.product)
        if want is None:
            continue
        path = f"migLayouts.{gpu.product}.layout"
        have = tuple(sorted(i.profile for i in gpu.instances)) if gpu.mode == "mig" else ()
        if gpu.mode == "mig" and have == tuple(sorted(want)):
            continue
        carries = (f"carries MIG instances [{', '.join(have)}]" if gpu.mode == "mig"
                   else f"is in {gpu.mode} mode, not MIG")
        yield ((gpu.uuid, gpu.mode, *have),
               f"GPU {gpu.index} ({gpu.uuid}, {gpu.product}) {carries}, but {path} says it carries "
               f"[{', '.join(want)}]; gpu-slice advertises what the GPU carries. Lay the GPU out with the GPU "
               f"Operator's MIG manager (label nvidia.com/mig.config) or mig-parted, or correct {path}")
