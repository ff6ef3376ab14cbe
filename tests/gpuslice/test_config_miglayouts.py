"""The config's migLayouts field: per product, a static layout and the dynamic switch, refused by field."""

from __future__ import annotations

import pytest

from gpuslice.config import default_config, load_config, load_config_text
from gpuslice.errors import ConfigError


def test_default_is_static_everywhere() -> None:
    assert default_config().mig_layouts == {} and default_config().dynamic_mig_products() == frozenset()


def test_dynamic_per_product_and_a_static_layout() -> None:
    c = load_config_text("version: v1\nmodes: {products: {H100-80GB: mig}}\nmigLayouts:\n  H100-80GB:\n"
                         "    layout: [3g.40gb, 2g.20gb, 1g.10gb, 1g.10gb]\n    dynamic: true\n"
                         "  A100-80GB: {dynamic: false}\n")
    assert c.dynamic_mig_products() == frozenset({"H100-80GB"})
    assert c.mig_layouts["H100-80GB"].layout == ("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb")


@pytest.mark.parametrize("entry, path, message", [
    ({"L4": {}}, "migLayouts.L4", "does not support MIG"),
    ({"H999": {}}, "migLayouts.H999", "unknown GPU product"),
    ({"H100-80GB": {"layout": ["5g.50gb"]}}, "migLayouts.H100-80GB.layout.0", "'5g.50gb' is not a MIG profile"),
    ({"H100-80GB": {"layout": ["4g.40gb", "4g.40gb"]}}, "migLayouts.H100-80GB.layout", "cannot all be placed"),
    ({"H100-80GB": {"dynamic": "yes"}}, "migLayouts.H100-80GB.dynamic", "must be true or false"),
    ({"H100-80GB": {"dinamic": True}}, "migLayouts.H100-80GB.dinamic", "unknown field"),
])
def test_bad_entries_stop_startup_naming_the_field(entry: dict[str, object], path: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"version": "v1", "modes": {"products": {"H100-80GB": "mig"}}, "migLayouts": entry})
    assert any(p == path and message in m for p, m in info.value.errors), info.value.errors
