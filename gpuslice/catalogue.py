"""The product catalogue: GPU models and their MIG profiles, as data.

Sizes are what NVML reports (MiB), taken from ``nvidia-smi mig -lgip`` captures and the MIG User Guide
(reference/protocols.md section 5). Placements are the legal memory-slice start positions: a GPU
instance of profile P may start only at one of ``P.starts`` and covers ``P.memory_slices`` slices.
A30 figures and the A100-80GB/H200 placements follow NVIDIA's guide but were not captured from a
device; the undisclosed Alibaba models G1/G2/G3 have no known memory size (``None``).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuslice.errors import CatalogueError


@dataclass(frozen=True, slots=True)
class MigProfile:
    """One GPU-instance profile of one product (``3g.40gb`` on H100-80GB, say)."""

    name: str
    profile_id: int
    compute_slices: int
    memory_slices: int
    max_count: int
    memory_mib: int
    starts: tuple[int, ...]
    sms: int = 0

    def covers(self, start: int) -> frozenset[int]:
        """The memory slices an instance of this profile occupies when it starts at ``start``."""
        return frozenset(range(start, start + self.memory_slices))


@dataclass(frozen=True, slots=True)
class Product:
    """A GPU model: its memory, and its MIG geometry when it has one."""

    name: str
    memory_mib: int | None
    compute_slices: int = 0
    memory_slices: int = 0
    mig_profiles: tuple[MigProfile, ...] = ()
    nvml_names: tuple[str, ...] = ()

    @property
    def mig_capable(self) -> bool:
        return bool(self.mig_profiles)

    def profile(self, name: str) -> MigProfile:
        """Look up a MIG profile by name (``1g.10gb``); raise ``CatalogueError`` naming the valid ones."""
        for prof in self.mig_profiles:
            if prof.name == name:
                return prof
        known = ", ".join(p.name for p in self.mig_profiles) or "none (not MIG-capable)"
        raise CatalogueError(f"{self.name} has no MIG profile {name!r}; known: {known}")

    def profile_by_id(self, profile_id: int) -> MigProfile:
        for prof in self.mig_profiles:
            if prof.profile_id == profile_id:
                return prof
        raise CatalogueError(f"{self.name} has no MIG profile with id {profile_id}")


def _seven_slice_profiles(sizes: dict[str, int], names: tuple[str, ...], sms: tuple[int, ...]) -> tuple[
        MigProfile, ...]:
    """The A100/H100/H200 geometry: 7 compute and 8 memory slices, identical placements."""
    one, one_me, one_double, two, three, four, seven = names
    return (
        MigProfile(one, 19, 1, 1, 7, sizes["1"], (0, 1, 2, 3, 4, 5, 6), sms[0]),
        MigProfile(one_me, 20, 1, 1, 1, sizes["1"], (0, 1, 2, 3, 4, 5, 6), sms[0]),
        MigProfile(one_double, 15, 1, 2, 4, sizes["2"], (0, 2, 4, 6), sms[1]),
        MigProfile(two, 14, 2, 2, 3, sizes["2"], (0, 2, 4), sms[2]),
        MigProfile(three, 9, 3, 4, 2, sizes["4"], (0, 4), sms[3]),
        MigProfile(four, 5, 4, 4, 1, sizes["4"], (0,), sms[4]),
        MigProfile(seven, 0, 7, 8, 1, sizes["8"], (0,), sms[5]),
    )


_A100_SMS = (14, 14, 28, 42, 56, 98)
_H100_SMS = (16, 26, 32, 60, 64, 132)

PRODUCTS: dict[str, Product] = {
    p.name: p
    for p in (
        Product("A100-40GB", 40960, 7, 8, _seven_slice_profiles(
            {"1": 4864, "2": 9856, "4": 19968, "8": 40192},
            ("1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"), _A100_SMS),
            ("NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB")),
        Product("A100-80GB", 81920, 7, 8, _seven_slice_profiles(
            {"1": 9728, "2": 19968, "4": 40192, "8": 80640},
            ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"), _A100_SMS),
            ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe")),
        Product("H100-80GB", 81559, 7, 8, _seven_slice_profiles(
            {"1": 9984, "2": 20096, "4": 40448, "8": 81152},
            ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"), _H100_SMS),
            ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100-SXM5-80GB")),
        Product("H200-141GB", 143771, 7, 8, _seven_slice_profiles(
            {"1": 16384, "2": 33280, "4": 71168, "8": 143360},
            ("1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"), _H100_SMS),
            ("NVIDIA H200", "NVIDIA H200 NVL")),
        Product("A30-24GB", 24576, 4, 4, (
            MigProfile("1g.6gb", 14, 1, 1, 4, 5952, (0, 1, 2, 3), 14),
            MigProfile("1g.6gb+me", 21, 1, 1, 1, 5952, (0, 1, 2, 3), 14),
            MigProfile("2g.12gb", 5, 2, 2, 2, 11968, (0, 2), 28),
            MigProfile("2g.12gb+me", 6, 2, 2, 1, 11968, (0, 2), 28),
            MigProfile("4g.24gb", 0, 4, 4, 1, 24064, (0,), 56),
        ), ("NVIDIA A30",)),
        Product("L4", 23034, nvml_names=("NVIDIA L4",)),
        Product("L40S", 46068, nvml_names=("NVIDIA L40S",)),
        Product("A10", 23028, nvml_names=("NVIDIA A10",)),
        Product("T4", 15360, nvml_names=("Tesla T4",)),
        Product("P100", 16384, nvml_names=("Tesla P100-PCIE-16GB", "Tesla P100-SXM2-16GB")),
        Product("V100M16", 16384, nvml_names=("Tesla V100-SXM2-16GB", "Tesla V100-PCIE-16GB")),
        Product("V100M32", 32768, nvml_names=("Tesla V100-SXM2-32GB", "Tesla V100-PCIE-32GB")),
        Product("G1", None),
        Product("G2", None),
        Product("G3", None),
    )
}


def product(name: str) -> Product:
    """Look up a product by catalogue name; raise ``CatalogueError`` listing the known names."""
    try:
        return PRODUCTS[name]
    except KeyError:
        raise CatalogueError(f"unknown GPU product {name!r}; known: {', '.join(PRODUCTS)}") from None


def product_for_nvml_name(nvml_name: str) -> Product:
    """Map the name NVML reports (``NVIDIA H100 80GB HBM3``) to a catalogue product."""
    for prod in PRODUCTS.values():
        if nvml_name in prod.nvml_names:
            return prod
    raise CatalogueError(f"GPU model {nvml_name!r} is not in the catalogue")
