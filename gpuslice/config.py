"""The versioned config shared by the extender, the device plugin and the simulator.

The file is YAML with camelCase keys; ``version: v1`` is required so a future schema can be told
apart instead of half-read. Every key is validated at start-up (unknown keys refused) and each
problem is reported with its dotted field path (``policies.1.weight: must be >= 0``), because a
typo that silently falls back to a default is worse than a service that will not start.

Reading the file is the services' job; this module only validates a mapping or YAML text::

    version: v1
    slices: 7                      # S: slices per mps/whole GPU (1..48; the simulator up to 1000)
    modes:
      default: whole               # whole | mps | mig
      products: {H100-80GB: mig}   # catalogue product names
      gpus: {GPU-0b1c…: mps}       # per GPU UUID, wins over products and default
    mpsLimits: memory-and-threads  # or memory-only
    memoryTolerance: 0.03          # 0..0.2
    isolationDefault: any          # mig | mps | any
    policies: [{name: fragmentation, weight: 1}, {name: cost, weight: 1}, {name: utilization, weight: 1}]  # default
    narrowing: {margin: 0.0}
    reservationTTLSeconds: 60
    ownerSpread: true
    prices:
      instanceTypes: {p5.48xlarge: {on-demand: 98.32, spot: 39.3}}   # $/node-hour
      gpuHourly: {H100-80GB: 4.1}                                     # $/GPU-hour fallback
    migLayouts:                    # per MIG-capable catalogue product; others keep whatever they carry
      H100-80GB:
        layout: [3g.40gb, 2g.20gb, 1g.10gb, 1g.10gb]   # the static layout such GPUs carry
        dynamic: false             # re-cut free slots to Pending demand: not built yet, only false
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Mapping
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from gpuslice import ids
from gpuslice.catalogue import PRODUCTS
from gpuslice.errors import ConfigError, GpuSliceError
from gpuslice.model import GpuMode

CONFIG_VERSION = "v1"
MAX_SLICES_REAL = 48  # MPS client limit per daemon
MAX_SLICES_SIMULATOR = 1000  # milli-GPU, simulator only
DEFAULT_SLICES = 7
MAX_MEMORY_TOLERANCE = 0.2

_CONTEXT_MAX_SLICES = "max_slices"
_CONTEXT_POLICIES = "policy_names"
_SUBPATH = "subpath"  # error ctx key: a dict key below the field, appended to the error's path


def registered_policy_names() -> tuple[str, ...]:
    """The policy registry's names: the registry is the authority, so a listed but unbuilt policy never validates."""
    from gpuslice.policies import registry

    return registry.known()


class _Strict(BaseModel):
    """Frozen, unknown keys refused, camelCase names only (what the file says is what we read)."""

    # defer_build: the validator is built on first use, so importing the core stays light (pydantic's
    # plugin loader pulls in importlib.metadata, email and socket when a validator is built).
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=False, strict=False, defer_build=True)


class Modes(_Strict):
    """GPU modes: a default, per product, per GPU UUID (most specific wins)."""

    default: GpuMode = "whole"
    products: dict[str, GpuMode] = Field(default_factory=dict)
    gpus: dict[str, GpuMode] = Field(default_factory=dict)

    @field_validator("products")
    @classmethod
    def _known_products(cls, value: dict[str, GpuMode]) -> dict[str, GpuMode]:
        for name, mode in value.items():
            if name not in PRODUCTS:
                raise _unknown_product(name)
            if mode == "mig" and not PRODUCTS[name].mig_capable:
                raise PydanticCustomError(
                    "not_mig_capable", "mode mig needs a MIG-capable product; {name} is not",
                    {"name": name, _SUBPATH: name})
        return value

    @field_validator("gpus")
    @classmethod
    def _gpu_uuids(cls, value: dict[str, GpuMode]) -> dict[str, GpuMode]:
        for uuid in value:
            try:
                ids.encode(uuid, 0)
            except GpuSliceError as err:
                raise PydanticCustomError("bad_uuid", "{err}", {"err": str(err), _SUBPATH: uuid}) from None
            if not uuid.startswith("GPU-"):
                raise PydanticCustomError("bad_uuid", "'{uuid}' is not a GPU UUID (GPU-…)",
                                          {"uuid": uuid, _SUBPATH: uuid})
        return value


class PolicyWeight(_Strict):
    """One scoring policy and its weight in the sum."""

    name: str
    weight: float = Field(default=1.0, ge=0, allow_inf_nan=False, strict=True)

    @field_validator("name")
    @classmethod
    def _registered(cls, value: str, info: ValidationInfo) -> str:
        names = _context(info).get(_CONTEXT_POLICIES) or registered_policy_names()
        if value not in names:
            raise PydanticCustomError(
                "unknown_policy", "unknown policy '{name}'; known: {known}",
                {"name": value, "known": ", ".join(names)})
        return value


class Narrowing(_Strict):
    """The narrowed filter: placements scoring within ``margin`` of the best count as tied."""

    margin: float = Field(default=0.0, ge=0, le=1, allow_inf_nan=False, strict=True)


class Prices(_Strict):
    """Fallback prices when OpenCost has no figure: per node-hour, else per GPU-hour by product."""

    instance_types: dict[str, dict[str, float]] = Field(default_factory=dict, alias="instanceTypes")
    gpu_hourly: dict[str, float] = Field(default_factory=dict, alias="gpuHourly")

    @field_validator("instance_types")
    @classmethod
    def _node_prices(cls, value: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        for itype, by_capacity in value.items():
            for capacity, price in by_capacity.items():
                _check_price(price, f"{itype}.{capacity}")
        return value

    @field_validator("gpu_hourly")
    @classmethod
    def _gpu_prices(cls, value: dict[str, float]) -> dict[str, float]:
        for name, price in value.items():
            if name not in PRODUCTS:
                raise _unknown_product(name)
            _check_price(price, name)
        return value


class MigLayout(_Strict):
    """One product's MIG layout: the static layout its GPUs carry (profile names, validated as a real
    placement on the product; made on the node by the GPU Operator's MIG manager or mig-parted, never
    by gpu-slice) and whether free placement slots follow demand (``dynamic``: not built yet)."""

    layout: tuple[str, ...] | None = None
    dynamic: bool = Field(default=False, strict=True)

    @field_validator("dynamic")
    @classmethod
    def _static_only(cls, value: bool) -> bool:
        if value:
            raise PydanticCustomError(
                "dynamic_not_built", "dynamic MIG layouts (re-cut to Pending demand) are not built in this "
                "version; set dynamic: false and keep the layout static", {})
        return value


def _check_mig_layouts(value: dict[str, MigLayout]) -> dict[str, MigLayout]:
    from gpuslice.model import place_mig_layout

    for name, entry in value.items():
        if name not in PRODUCTS:
            raise _unknown_product(name)
        prod = PRODUCTS[name]
        if not prod.mig_capable:
            raise PydanticCustomError("not_mig_capable", "{name} does not support MIG",
                                      {"name": name, _SUBPATH: name})
        if entry.layout is None:
            continue
        if not entry.layout:
            raise PydanticCustomError("empty_layout", "list at least one MIG profile",
                                      {_SUBPATH: f"{name}.layout"})
        known = [p.name for p in prod.mig_profiles]
        for n, profile in enumerate(entry.layout):
            if profile not in known:
                raise PydanticCustomError(
                    "unknown_profile", "'{profile}' is not a MIG profile of {name}; known: {known}",
                    {"profile": profile, "name": name, "known": ", ".join(known), _SUBPATH: f"{name}.layout.{n}"})
        try:
            place_mig_layout(name, entry.layout, where=f"the {name} layout")
        except GpuSliceError as err:
            raise PydanticCustomError("bad_layout", "{err}", {"err": str(err), _SUBPATH: f"{name}.layout"}) from None
    return value


def _unknown_product(name: str) -> PydanticCustomError:
    return PydanticCustomError("unknown_product", "unknown GPU product '{name}'; known: {known}",
                               {"name": name, "known": ", ".join(PRODUCTS), _SUBPATH: name})


def _check_price(price: float, where: str) -> None:
    if not price >= 0 or price == float("inf"):
        raise PydanticCustomError("bad_price", "price must be a finite number >= 0, got {price}",
                                  {"price": price, _SUBPATH: where})


#: The default scoring, the one place it is chosen: FGD-style packing against the online target
#: (memory- and isolation-aware, MIG GPUs consolidated) plus ``cost`` (cheap capacity, nodes already
#: paid for) plus ``utilization`` (away from GPUs DCGM reports near saturation; activity below its
#: ``HOT_FROM`` is headroom, so moderately busy GPUs still take pods). Without prices or fresh DCGM samples
#: those parts have no signal and the mix scores exactly as ``fragmentation`` alone
#: (``gpuslice.policies.registry``). Measured on the built-in LLM day: bench/bench_builtin.py.
DEFAULT_POLICIES: tuple[tuple[str, float], ...] = (("fragmentation", 1.0), ("cost", 1.0), ("utilization", 1.0))


def default_policy_spec() -> str:
    """The default policies as a registry spec, e.g. ``fragmentation:1,cost:1,utilization:1``."""
    return ",".join(f"{name}:{weight:g}" for name, weight in DEFAULT_POLICIES)


def _default_policies() -> list[PolicyWeight]:
    return [PolicyWeight.model_construct(name=name, weight=weight) for name, weight in DEFAULT_POLICIES]


class Config(_Strict):
    """The validated config; immutable so services can share it between threads."""

    version: Literal["v1"]
    slices: int = Field(default=DEFAULT_SLICES, strict=True)
    modes: Modes = Field(default_factory=Modes)
    mps_limits: Literal["memory-and-threads", "memory-only"] = Field(
        default="memory-and-threads", alias="mpsLimits")
    memory_tolerance: float = Field(
        default=0.03, ge=0, le=MAX_MEMORY_TOLERANCE, alias="memoryTolerance", allow_inf_nan=False,
        strict=True)
    isolation_default: Literal["mig", "mps", "any"] = Field(default="any", alias="isolationDefault")
    policies: tuple[PolicyWeight, ...] = Field(default_factory=lambda: tuple(_default_policies()))
    narrowing: Narrowing = Field(default_factory=Narrowing)
    reservation_ttl_seconds: float = Field(
        default=60.0, gt=0, le=3600, alias="reservationTTLSeconds", allow_inf_nan=False, strict=True)
    owner_spread: bool = Field(default=True, alias="ownerSpread", strict=True)
    prices: Prices = Field(default_factory=Prices)
    mig_layouts: dict[str, MigLayout] = Field(default_factory=dict, alias="migLayouts")

    @field_validator("mig_layouts")
    @classmethod
    def _mig_layouts(cls, value: dict[str, MigLayout]) -> dict[str, MigLayout]:
        return _check_mig_layouts(value)

    @field_validator("slices")
    @classmethod
    def _slices_range(cls, value: int, info: ValidationInfo) -> int:
        limit = int(_context(info).get(_CONTEXT_MAX_SLICES, MAX_SLICES_REAL))
        if not 1 <= value <= limit:
            where = "in the simulator" if limit > MAX_SLICES_REAL else "on real nodes (the MPS client limit)"
            raise PydanticCustomError(
                "slices_range", "must be between 1 and {limit} {where}, got {value}",
                {"limit": limit, "where": where, "value": value})
        return value

    @field_validator("policies")
    @classmethod
    def _policies(cls, value: tuple[PolicyWeight, ...]) -> tuple[PolicyWeight, ...]:
        if not value:
            raise PydanticCustomError("no_policy", "list at least one policy", {})
        names = [p.name for p in value]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise PydanticCustomError("duplicate_policy", "policy {names} listed more than once",
                                      {"names": ", ".join(dupes)})
        if not any(p.weight > 0 for p in value):
            raise PydanticCustomError("zero_weights", "at least one policy weight must be > 0", {})
        return value

    def mode_for(self, product_name: str, uuid: str) -> GpuMode:
        """The mode of one GPU: per-UUID entry, else per-product, else the default.

        A ``mig`` that reaches a product without MIG (through the default or a UUID entry, which
        cannot be checked before the GPU is seen) raises ``ConfigError`` rather than guessing.
        """
        mode = self.modes.gpus.get(uuid) or self.modes.products.get(product_name) or self.modes.default
        if mode == "mig" and not (product_name in PRODUCTS and PRODUCTS[product_name].mig_capable):
            path = f"modes.gpus.{uuid}" if uuid in self.modes.gpus else "modes.default"
            raise ConfigError([(path, f"GPU {uuid} is a {product_name}, which does not support mig mode")])
        return mode

    @model_validator(mode="after")
    def _layouts_are_for_mig_gpus(self) -> Config:
        for name, entry in self.mig_layouts.items():
            mode = self.modes.products.get(name) or self.modes.default
            if entry.layout is not None and mode != "mig":
                raise PydanticCustomError(
                    "layout_not_mig", "a MIG layout for {name} GPUs, but modes gives {name} mode {mode}; set "
                    "modes.products.{name}: mig", {"name": name, "mode": mode, _SUBPATH: f"migLayouts.{name}"})
        return self

    def mig_layout_for(self, product_name: str) -> tuple[str, ...] | None:
        """The static MIG layout the config says GPUs of this product carry (None: not said)."""
        entry = self.mig_layouts.get(product_name)
        return None if entry is None else entry.layout

    def policy_weights(self) -> dict[str, float]:
        """Policy name → weight, in config order."""
        return {p.name: p.weight for p in self.policies}

    def node_price(self, instance_type: str | None, capacity_type: str | None) -> float | None:
        """$/hour of a node from the price table, or ``None`` when the table has no such entry."""
        if instance_type is None:
            return None
        by_capacity = self.prices.instance_types.get(instance_type) or {}
        return by_capacity.get(capacity_type or "on-demand")

    def gpu_price(self, product_name: str) -> float | None:
        """$/GPU-hour for a product from the fallback table."""
        return self.prices.gpu_hourly.get(product_name)


def _context(info: ValidationInfo) -> Mapping[str, Any]:
    ctx = info.context
    return ctx if isinstance(ctx, Mapping) else {}


def _num(value: object) -> str:
    """``0`` rather than ``0.0`` in messages: bounds are written as integers in the docs."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


_MESSAGES: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "extra_forbidden": lambda ctx: "unknown field",
    "missing": lambda ctx: "required field missing",
    "greater_than_equal": lambda ctx: f"must be >= {_num(ctx.get('ge'))}",
    "greater_than": lambda ctx: f"must be > {_num(ctx.get('gt'))}",
    "less_than_equal": lambda ctx: f"must be <= {_num(ctx.get('le'))}",
    "less_than": lambda ctx: f"must be < {_num(ctx.get('lt'))}",
    "literal_error": lambda ctx: f"must be one of {ctx.get('expected')}",
    "int_type": lambda ctx: "must be an integer",
    "int_parsing": lambda ctx: "must be an integer",
    "int_from_float": lambda ctx: "must be an integer",
    "float_type": lambda ctx: "must be a number",
    "float_parsing": lambda ctx: "must be a number",
    "finite_number": lambda ctx: "must be a finite number",
    "bool_type": lambda ctx: "must be true or false",
    "bool_parsing": lambda ctx: "must be true or false",
    "string_type": lambda ctx: "must be a string",
    "dict_type": lambda ctx: "must be a mapping",
    "model_type": lambda ctx: "must be a mapping",
    "list_type": lambda ctx: "must be a list",
    "tuple_type": lambda ctx: "must be a list",
}


def _path(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in loc if part != "[key]")


def _errors(err: ValidationError) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for item in err.errors(include_url=False):
        kind = item["type"]
        ctx = item.get("ctx") or {}
        render = _MESSAGES.get(kind)
        message = render(ctx) if render is not None else item["msg"]
        if kind == "literal_error" and item["loc"] and item["loc"][-1] == "version":
            message = f"unsupported config version {item.get('input')!r}; this build reads {CONFIG_VERSION}"
        loc = tuple(item["loc"])
        if _SUBPATH in ctx:
            loc = (*loc, str(ctx[_SUBPATH]))
        out.append((_path(loc), message))
    return out


def load_config(data: object, *, simulator: bool = False,
                policy_names: Collection[str] | None = None) -> Config:
    """Validate a parsed config; raise ``ConfigError`` listing every problem with its field path.

    ``simulator`` lifts the slices limit from 48 to 1000 (milli-GPU, never on a real node);
    ``policy_names`` overrides the registry (tests, or a service that registers extra policies).
    """
    if not isinstance(data, Mapping):
        got = "an empty document" if data is None else type(data).__name__
        raise ConfigError([("", f"config must be a mapping with version: {CONFIG_VERSION}, got {got}")])
    if "version" not in data:
        raise ConfigError([("version", f"required field missing; this build reads {CONFIG_VERSION}")])
    if data["version"] != CONFIG_VERSION:
        raise ConfigError(
            [("version", f"unsupported config version {data['version']!r}; this build reads {CONFIG_VERSION}")])
    context: dict[str, Any] = {
        _CONTEXT_MAX_SLICES: MAX_SLICES_SIMULATOR if simulator else MAX_SLICES_REAL,
        _CONTEXT_POLICIES: tuple(policy_names) if policy_names is not None else registered_policy_names(),
    }
    try:
        return Config.model_validate(dict(data), context=context)
    except ValidationError as err:
        raise ConfigError(_errors(err)) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """Safe YAML that refuses duplicate keys (PyYAML keeps the last one silently)."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Hashable, Any]:
    loader.flatten_mapping(node)
    out: dict[Hashable, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in out:
            mark = key_node.start_mark
            raise yaml.constructor.ConstructorError(None, None, f"key {key!r} appears twice", mark)
        out[key] = loader.construct_object(value_node, deep=True)
    return out


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_config_text(text: str, *, simulator: bool = False,
                     policy_names: Collection[str] | None = None) -> Config:
    """Parse YAML text and validate it (see ``load_config``)."""
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass: no object tags
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError([("", f"not valid YAML{where}: {err.problem or err.context}")]) from None
    except yaml.YAMLError as err:
        raise ConfigError([("", f"not valid YAML: {err}")]) from None
    except RecursionError:
        raise ConfigError([("", "not a config: nested too deeply")]) from None
    except TypeError as err:  # e.g. a list used as a mapping key ("? [a]")
        raise ConfigError([("", f"not a config: {err}")]) from None
    return load_config(data, simulator=simulator, policy_names=policy_names)


def default_config(*, simulator: bool = False) -> Config:
    """The config a service runs with when no file is given."""
    return load_config({"version": CONFIG_VERSION}, simulator=simulator)
