"""The product catalogue as data: checked against reference/protocols.md section 5."""

from __future__ import annotations

import pytest

from gpuslice.catalogue import PRODUCTS, product, product_for_nvml_name
from gpuslice.errors import CatalogueError

SEVEN = ("A100-40GB", "A100-80GB", "H100-80GB", "H200-141GB")


@pytest.mark.parametrize("name", SEVEN)
def test_seven_slice_geometry(name: str) -> None:
    prod = product(name)
    assert prod.compute_slices == 7 and prod.memory_slices == 8 and prod.mig_capable
    by_id = {p.profile_id: p for p in prod.mig_profiles}
    assert sorted(by_id) == [0, 5, 9, 14, 15, 19, 20]
    assert by_id[19].starts == (0, 1, 2, 3, 4, 5, 6) and by_id[19].memory_slices == 1 and by_id[19].max_count == 7
    assert by_id[20].name.endswith("+me") and by_id[20].max_count == 1
    assert by_id[15].starts == (0, 2, 4, 6) and by_id[15].memory_slices == 2 and by_id[15].compute_slices == 1
    assert by_id[14].starts == (0, 2, 4) and by_id[14].compute_slices == 2 and by_id[14].max_count == 3
    assert by_id[9].starts == (0, 4) and by_id[9].memory_slices == 4 and by_id[9].compute_slices == 3
    assert by_id[5].starts == (0,) and by_id[5].compute_slices == 4
    assert by_id[0].starts == (0,) and by_id[0].memory_slices == 8 and by_id[0].compute_slices == 7
    for prof in prod.mig_profiles:  # no instance starts at memory slice 7
        assert 7 not in prof.starts
        assert max(prof.starts) + prof.memory_slices <= 8


def test_h100_sizes_and_names() -> None:
    h100 = product("H100-80GB")
    sizes = {p.name: p.memory_mib for p in h100.mig_profiles}
    assert sizes == {"1g.10gb": 9984, "1g.10gb+me": 9984, "1g.20gb": 20096, "2g.20gb": 20096, "3g.40gb": 40448,
                     "4g.40gb": 40448, "7g.80gb": 81152}
    assert round(sizes["1g.20gb"] / 1024, 2) == 19.62
    assert round(sizes["1g.10gb"] / 1024, 2) == 9.75
    assert [p.sms for p in h100.mig_profiles] == [16, 16, 26, 32, 60, 64, 132]


def test_profile_names_per_product() -> None:
    assert [p.name for p in product("A100-40GB").mig_profiles] == [
        "1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"]
    assert [p.name for p in product("H200-141GB").mig_profiles] == [
        "1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"]
    assert product("H200-141GB").profile("1g.18gb").memory_mib == 16384


def test_a30() -> None:
    a30 = product("A30-24GB")
    assert a30.compute_slices == 4 and a30.memory_slices == 4
    assert sorted({p.compute_slices for p in a30.mig_profiles}) == [1, 2, 4]


def test_profiles_fit_their_product() -> None:
    for prod in PRODUCTS.values():
        if prod.memory_mib is not None:
            assert all(p.memory_mib <= prod.memory_mib for p in prod.mig_profiles)
        for p in prod.mig_profiles:
            assert p.compute_slices <= prod.compute_slices
            assert all(s + p.memory_slices <= prod.memory_slices for s in p.starts)
            assert p.covers(p.starts[-1]) == frozenset(range(p.starts[-1], p.starts[-1] + p.memory_slices))


def test_non_mig_products() -> None:
    for name in ("L4", "L40S", "A10", "T4", "P100", "V100M16", "V100M32", "G1"):
        assert not product(name).mig_capable
    assert product("G2").memory_mib is None


def test_lookups_and_refusals() -> None:
    assert product_for_nvml_name("NVIDIA H100 80GB HBM3").name == "H100-80GB"
    assert product_for_nvml_name("Tesla T4").name == "T4"
    with pytest.raises(CatalogueError) as err:
        product("B200")
    assert str(err.value).startswith("unknown GPU product 'B200'; known: A100-40GB, A100-80GB, H100-80GB")
    with pytest.raises(CatalogueError, match=r"GPU model 'NVIDIA B200' is not in the catalogue"):
        product_for_nvml_name("NVIDIA B200")
    with pytest.raises(CatalogueError) as err:
        product("H100-80GB").profile("5g.50gb")
    assert str(err.value) == ("H100-80GB has no MIG profile '5g.50gb'; known: 1g.10gb, 1g.10gb+me, 1g.20gb, "
                              "2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb")
    with pytest.raises(CatalogueError, match=r"L4 has no MIG profile '1g.5gb'; known: none \(not MIG-capable\)"):
        product("L4").profile("1g.5gb")
    assert product("H100-80GB").profile_by_id(9).name == "3g.40gb"
    with pytest.raises(CatalogueError, match=r"H100-80GB has no MIG profile with id 99"):
        product("H100-80GB").profile_by_id(99)


def test_nvml_names_unique() -> None:
    names = [n for p in PRODUCTS.values() for n in p.nvml_names]
    assert len(names) == len(set(names))
