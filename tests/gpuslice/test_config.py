"""The versioned config: defaults, every refusal with its dotted field path."""

from __future__ import annotations

import pytest

from gpuslice.config import (
    MAX_SLICES_REAL,
    Config,
    default_config,
    load_config,
    load_config_text,
    registered_policy_names,
)
from gpuslice.errors import ConfigError

FULL = """
version: v1
slices: 14
modes:
  default: mps
  products: {H100-80GB: mig, L4: whole}
  gpus: {GPU-5f3b9c1e-2a4d-4e6f-8a1b-3c5d7e9f0a12: whole}
mpsLimits: memory-only
memoryTolerance: 0.05
isolationDefault: mps
policies:
  - {name: fragmentation, weight: 0.7}
  - {name: utilization, weight: 0.2}
  - {name: cost, weight: 0.1}
narrowing: {margin: 0.01}
reservationTTLSeconds: 45
ownerSpread: false
prices:
  instanceTypes:
    p5.48xlarge: {on-demand: 98.32, spot: 39.33}
  gpuHourly: {H100-80GB: 4.1, L4: 0.8}
"""


def errors(text: str, **kwargs: object) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as err:
        load_config_text(text, **kwargs)  # type: ignore[arg-type]
    return err.value.errors


def test_defaults() -> None:
    cfg = default_config()
    assert cfg.slices == 7
    assert cfg.modes.default == "whole"
    assert cfg.mps_limits == "memory-and-threads"
    assert cfg.memory_tolerance == 0.03
    assert cfg.isolation_default == "any"
    assert cfg.policy_weights() == {"fragmentation": 1.0, "cost": 1.0, "utilization": 1.0}
    assert cfg.narrowing.margin == 0.0
    assert cfg.owner_spread is True
    assert cfg.reservation_ttl_seconds > 0


def test_full_config() -> None:
    cfg = load_config_text(FULL)
    assert isinstance(cfg, Config)
    assert cfg.slices == 14
    assert cfg.mode_for("H100-80GB", "GPU-other") == "mig"
    assert cfg.mode_for("H100-80GB", "GPU-5f3b9c1e-2a4d-4e6f-8a1b-3c5d7e9f0a12") == "whole"
    assert cfg.mode_for("A10", "GPU-x") == "mps"
    assert cfg.mps_limits == "memory-only"
    assert cfg.memory_tolerance == 0.05
    assert cfg.isolation_default == "mps"
    assert cfg.policy_weights() == {"fragmentation": 0.7, "utilization": 0.2, "cost": 0.1}
    assert cfg.narrowing.margin == 0.01
    assert cfg.reservation_ttl_seconds == 45
    assert cfg.owner_spread is False
    assert cfg.node_price("p5.48xlarge", "spot") == 39.33
    assert cfg.node_price("p5.48xlarge", None) == 98.32
    assert cfg.node_price("p4d.24xlarge", "spot") is None
    assert cfg.gpu_price("L4") == 0.8 and cfg.gpu_price("T4") is None


def test_config_is_immutable() -> None:
    cfg = default_config()
    with pytest.raises(Exception, match="frozen"):
        cfg.slices = 3


@pytest.mark.parametrize(("text", "expected"), [
    ("slices: 7", [("version", "required field missing; this build reads v1")]),
    ("version: v2", [("version", "unsupported config version 'v2'; this build reads v1")]),
    ("version: 1", [("version", "unsupported config version 1; this build reads v1")]),
    ("", [("", "config must be a mapping with version: v1, got an empty document")]),
    ("- version: v1", [("", "config must be a mapping with version: v1, got list")]),
    ("version: v1\nversion: v1", [("", "not valid YAML at line 2, column 1: key 'version' appears twice")]),
    ("version: v1\n  x: [", [("", "not valid YAML at line 2, column 4: mapping values are not allowed here")]),
])
def test_document_refusals(text: str, expected: list[tuple[str, str]]) -> None:
    assert errors(text) == expected


@pytest.mark.parametrize(("body", "expected"), [
    ("slices: 0", ("slices", "must be between 1 and 48 on real nodes (the MPS client limit), got 0")),
    ("slices: 49", ("slices", "must be between 1 and 48 on real nodes (the MPS client limit), got 49")),
    ("slices: '7'", ("slices", "must be an integer")),
    ("slices: 7.5", ("slices", "must be an integer")),
    ("slices: true", ("slices", "must be an integer")),
    ("modes: {default: shared}", ("modes.default", "must be one of 'mig', 'mps' or 'whole'")),
    ("modes: {products: {B200: mps}}",
     ("modes.products.B200", "unknown GPU product 'B200'; known: A100-40GB, A100-80GB, H100-80GB, H200-141GB, "
                             "A30-24GB, L4, L40S, A10, T4, P100, V100M16, V100M32, G1, G2, G3")),
    ("modes: {products: {L4: mig}}", ("modes.products.L4", "mode mig needs a MIG-capable product; L4 is not")),
    ("modes: {gpus: {MIG-abc: mps}}", ("modes.gpus.MIG-abc", "'MIG-abc' is not a GPU UUID (GPU-…)")),
    ("modes: {gpus: {'GPU-a:b': mps}}",
     ("modes.gpus.GPU-a:b", "device owner 'GPU-a:b' must be a GPU or MIG UUID without ':'")),
    ("modes: {gpu: {}}", ("modes.gpu", "unknown field")),
    ("mpsLimits: threads", ("mpsLimits", "must be one of 'memory-and-threads' or 'memory-only'")),
    ("mps_limits: memory-only", ("mps_limits", "unknown field")),
    ("memoryTolerance: 0.25", ("memoryTolerance", "must be <= 0.2")),
    ("memoryTolerance: -0.1", ("memoryTolerance", "must be >= 0")),
    ("memoryTolerance: .nan", ("memoryTolerance", "must be a finite number")),
    ("isolationDefault: none", ("isolationDefault", "must be one of 'mig', 'mps' or 'any'")),
    ("policies: [{name: fragmentation, weight: 1}, {name: binpack, weight: -1}]",
     ("policies.1.weight", "must be >= 0")),
    ("policies: [{name: fragmentation, weight: high}]", ("policies.0.weight", "must be a number")),
    ("policies: [{name: packing}]",
     ("policies.0.name", "unknown policy 'packing'; known: " + ", ".join(registered_policy_names()))),
    ("policies: [{weight: 1}]", ("policies.0.name", "required field missing")),
    ("policies: [{name: spread, wieght: 1}]", ("policies.0.wieght", "unknown field")),
    ("policies: []", ("policies", "list at least one policy")),
    ("policies: [{name: spread}, {name: spread}]", ("policies", "policy spread listed more than once")),
    ("policies: [{name: spread, weight: 0}]", ("policies", "at least one policy weight must be > 0")),
    ("policies: fragmentation", ("policies", "must be a list")),
    ("narrowing: {margin: 2}", ("narrowing.margin", "must be <= 1")),
    ("narrowing: 0.1", ("narrowing", "must be a mapping")),
    ("reservationTTLSeconds: 0", ("reservationTTLSeconds", "must be > 0")),
    ("reservationTtlSeconds: 10", ("reservationTtlSeconds", "unknown field")),
    ("ownerSpread: 'yes'", ("ownerSpread", "must be true or false")),
    ("prices: {instanceTypes: {p5.48xlarge: {spot: -1}}}",
     ("prices.instanceTypes.p5.48xlarge.spot", "price must be a finite number >= 0, got -1.0")),
    ("prices: {gpuHourly: {H101: 2}}",
     ("prices.gpuHourly.H101", "unknown GPU product 'H101'; known: A100-40GB, A100-80GB, H100-80GB, H200-141GB, "
                               "A30-24GB, L4, L40S, A10, T4, P100, V100M16, V100M32, G1, G2, G3")),
    ("extender: {port: 8888}", ("extender", "unknown field")),
    ("modes: {products: {H100-80GB: mig}}\nmigLayouts: {H100-80GB: {layout: [5g.50gb]}}",
     ("migLayouts.H100-80GB.layout.0", "'5g.50gb' is not a MIG profile of H100-80GB; known: 1g.10gb, 1g.10gb+me, "
                                       "1g.20gb, 2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb")),
    ("modes: {products: {H100-80GB: mig}}\nmigLayouts: {H100-80GB: {layout: [3g.40gb, 3g.40gb, 1g.10gb]}}",
     ("migLayouts.H100-80GB.layout", "the H100-80GB layout: 3g.40gb, 3g.40gb, 1g.10gb cannot all be placed on one "
                                     "H100-80GB (no legal memory-slice starts leave room for every instance)")),
    ("modes: {products: {H100-80GB: mig}}\nmigLayouts: {H100-80GB: {layout: [4g.40gb, 1g.10gb+me, 1g.10gb+me]}}",
     ("migLayouts.H100-80GB.layout", "the H100-80GB layout: more than 1 instances of 1g.10gb+me")),
    ("modes: {products: {H100-80GB: mig}}\nmigLayouts: {H100-80GB: {layout: [3g.40gb], dynamic: true}}",
     ("migLayouts.H100-80GB.dynamic", "dynamic MIG layouts (re-cut to Pending demand) are not built in this "
                                      "version; set dynamic: false and keep the layout static")),
    ("migLayouts: {L4: {layout: [1g.10gb]}}", ("migLayouts.L4", "L4 does not support MIG")),
    ("migLayouts: {H100-80GB: {layout: [3g.40gb]}}",
     ("migLayouts.H100-80GB", "a MIG layout for H100-80GB GPUs, but modes gives H100-80GB mode whole; set "
                              "modes.products.H100-80GB: mig")),
    ("modes: {products: {H100-80GB: mig}}\nmigLayouts: {H100-80GB: {layout: []}}",
     ("migLayouts.H100-80GB.layout", "list at least one MIG profile")),
    ("modes: {products: {H100-80GB: mig}}\nmigLayouts: {H100-80GB: {layuot: [3g.40gb]}}",
     ("migLayouts.H100-80GB.layuot", "unknown field")),
])
def test_field_refusals(body: str, expected: tuple[str, str]) -> None:
    assert errors(f"version: v1\n{body}") == [expected]


def test_every_problem_is_reported_at_once() -> None:
    found = errors("version: v1\nslices: 0\nownerSpread: 3\npolicies: [{name: spread, weight: -2}]\nfoo: 1")
    assert [path for path, _ in found] == ["slices", "policies.0.weight", "ownerSpread", "foo"]


def test_error_message_joins_paths() -> None:
    with pytest.raises(ConfigError) as err:
        load_config({"version": "v1", "policies": [{"name": "spread"}, {"name": "bestfit", "weight": -1}]})
    assert str(err.value) == "invalid config: policies.1.weight: must be >= 0"


def test_a_static_mig_layout_is_placed_and_read_per_product() -> None:
    cfg = load_config_text("version: v1\nmodes: {products: {H100-80GB: mig}}\nmigLayouts:\n  H100-80GB:\n"
                           "    layout: [3g.40gb, 2g.20gb, 1g.10gb, 1g.10gb]\n    dynamic: false\n")
    assert cfg.mig_layout_for("H100-80GB") == ("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb")
    assert cfg.mig_layout_for("A100-80GB") is None
    from gpuslice.model import place_mig_layout

    # 3g@0 leaves no legal start for a second 1g (1g starts at 0..6): the search moves 3g to 4.
    placed = place_mig_layout("H100-80GB", ["1g.10gb", "3g.40gb", "2g.20gb", "1g.10gb"], where="t")
    assert placed == (("1g.10gb", 2), ("3g.40gb", 4), ("2g.20gb", 0), ("1g.10gb", 3))


def test_simulator_allows_milli_gpu_slices() -> None:
    assert load_config_text("version: v1\nslices: 1000", simulator=True).slices == 1000
    assert errors("version: v1\nslices: 1001", simulator=True) == [
        ("slices", "must be between 1 and 1000 in the simulator, got 1001")]
    assert errors(f"version: v1\nslices: {MAX_SLICES_REAL + 1}") == [
        ("slices", "must be between 1 and 48 on real nodes (the MPS client limit), got 49")]


def test_policy_names_can_be_passed_in() -> None:
    assert load_config_text("version: v1\npolicies: [{name: mine}]", policy_names=["mine"]).policy_weights() == {
        "mine": 1.0}
    assert errors("version: v1\npolicies: [{name: spread}]", policy_names=["mine"]) == [
        ("policies.0.name", "unknown policy 'spread'; known: mine")]


def test_registry_names_include_service_policies() -> None:
    names = registered_policy_names()
    assert {"utilization", "cost", "fragmentation", "fgd", "bestfit"} <= set(names)


def test_mig_default_reaching_a_non_mig_gpu_is_refused_at_use() -> None:
    cfg = load_config_text("version: v1\nmodes: {default: mig, gpus: {GPU-1: mig}}")
    assert cfg.mode_for("A100-40GB", "GPU-9") == "mig"
    with pytest.raises(ConfigError) as err:
        cfg.mode_for("L4", "GPU-9")
    assert err.value.errors == [("modes.default", "GPU GPU-9 is a L4, which does not support mig mode")]
    with pytest.raises(ConfigError) as err:
        cfg.mode_for("T4", "GPU-1")
    assert err.value.errors == [("modes.gpus.GPU-1", "GPU GPU-1 is a T4, which does not support mig mode")]


@pytest.mark.parametrize(("text", "message"), [
    ("version: v1\n? [a]\n: 1\n", "not a config: unhashable type"),
    ("[" * 5000, "not a config: nested too deeply"),
])
def test_odd_yaml_is_a_config_error(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config_text(text)


def test_the_readme_configuration_example_is_a_valid_config() -> None:
    """What README "Configuration" shows (migLayouts included) is what this build accepts."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("\n## Configuration\n", 1)[1]
    block = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    cfg = load_config_text(block)
    assert cfg.mig_layout_for("H100-80GB") == ("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb")
