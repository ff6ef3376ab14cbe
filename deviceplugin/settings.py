"""The device plugin's settings: built once at start-up from flags over the config file, then frozen.

Every value is checked here, so a bad flag or config entry stops start-up with a message that names
the field, and no later code re-validates or reads the environment.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, get_args

from deviceplugin.errors import SettingsError
from gpuslice.config import Config, default_config, load_config_text
from gpuslice.errors import ConfigError
from gpuslice.requests import RESOURCE

BackendName = Literal["nvml", "simulated"]
Injection = Literal["cdi", "volume-mounts", "env"]
MpsDaemons = Literal["external", "plugin"]
BACKENDS: tuple[str, ...] = get_args(BackendName)
INJECTIONS: tuple[str, ...] = get_args(Injection)
MPS_DAEMONS: tuple[str, ...] = get_args(MpsDaemons)

DEFAULT_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins/")
DEFAULT_POD_RESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
DEFAULT_MPS_ROOT = Path("/run/gpu-slice/mps")
KUBELET_SOCKET_NAME = "kubelet.sock"
DEFAULT_CDI_SPEC_DIRS = (Path("/etc/cdi"), Path("/var/run/cdi"))

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_CDI_VENDOR = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.-]*[A-Za-z0-9]$")
_CDI_CLASS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
_SOCKET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*\.sock$")


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything the plugin is told; see ``cli.add_arguments`` for the flag of each field."""

    node_name: str
    backend: BackendName = "nvml"
    topology: Path | None = None
    plugin_dir: Path = DEFAULT_PLUGIN_DIR
    endpoint: str = "gpu-slice.sock"
    resource_name: str = RESOURCE
    pod_resources_socket: Path = DEFAULT_POD_RESOURCES_SOCKET
    kubeconfig: Path | None = None
    use_kube: bool = True
    device_injection: Injection = "cdi"
    cdi_vendor: str = "nvidia.com"
    cdi_spec_dirs: tuple[Path, ...] = DEFAULT_CDI_SPEC_DIRS
    cdi_class: str = "gpu"
    cdi_validate: bool | None = None  # None: on with the nvml backend and CDI injection
    conflict_taint: bool = False
    metrics_port: int = 9402
    metrics_address: str = "0.0.0.0"
    read_only: bool = False
    mps_root: Path | None = None
    mps_daemons: MpsDaemons | None = None  # None: external with nvml, plugin with the simulated backend
    mps_memory_limit_only: bool = False
    budget_s: float = 10.0
    budget_evict: bool = False
    proc_root: Path = Path("/proc")
    kubelet_warn_s: float = 30.0
    dir_poll_s: float = 0.2
    register_timeout_s: float = 10.0
    preferred_wait_s: float = 5.0
    preferred_wait_empty_s: float = 30.0
    rediscover_s: float = 0.5
    reconcile_s: float = 10.0
    stamp_resync_s: float = 5.0
    stamp_retries: int = 8
    stamp_backoff_s: float = 0.1
    kube_timeout_s: float = 10.0
    config_file: Path | None = None
    config: Config = field(default_factory=default_config)

    @property
    def socket_path(self) -> Path:
        return self.plugin_dir / self.endpoint

    @property
    def mps_dir(self) -> Path:
        """The MPS root: as given, else the host path on real nodes and a temp dir when simulated."""
        if self.mps_root is not None:
            return self.mps_root
        if self.backend == "simulated":
            return Path(tempfile.gettempdir()) / f"gpu-slice-mps-{self.node_name}"
        return DEFAULT_MPS_ROOT

    @property
    def kubelet_socket(self) -> Path:
        return self.plugin_dir / KUBELET_SOCKET_NAME

    @property
    def daemons(self) -> MpsDaemons:
        """Who runs the MPS control daemons: the gpu-slice-mps DaemonSet (``external``, the default on
        real nodes) or this process (``plugin``: the simulated quick start, a node without it)."""
        if self.mps_daemons is not None:
            return self.mps_daemons
        return "external" if self.backend == "nvml" else "plugin"

    @property
    def validate_cdi(self) -> bool:
        """Whether advertised GPUs and MIG instances are checked against the CDI spec's device names."""
        if self.device_injection != "cdi":
            return False
        return self.cdi_validate if self.cdi_validate is not None else self.backend == "nvml"

    def validate(self) -> Settings:
        """Check every field; raise ``SettingsError`` naming the first bad one."""
        if not self.node_name:
            raise SettingsError("node_name", "is required (--node-name or the NODE_NAME environment variable)")
        if not _DNS_SUBDOMAIN.match(self.node_name):
            raise SettingsError("node_name", f"{self.node_name!r} is not a valid Kubernetes node name")
        if self.backend not in BACKENDS:
            raise SettingsError("backend", f"must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.topology is not None and self.backend != "simulated":
            raise SettingsError("topology", "is only read by the simulated backend")
        if self.topology is not None and not self.topology.is_file():
            raise SettingsError("topology", f"file {self.topology} does not exist")
        if self.device_injection not in INJECTIONS:
            raise SettingsError("device_injection",
                                f"must be one of {', '.join(INJECTIONS)}, got {self.device_injection!r}")
        if not _CDI_VENDOR.match(self.cdi_vendor):
            raise SettingsError("cdi_vendor", f"{self.cdi_vendor!r} is not a CDI vendor name such as nvidia.com")
        if not _CDI_CLASS.match(self.cdi_class):
            raise SettingsError("cdi_class", f"{self.cdi_class!r} is not a CDI class name such as gpu")
        if not _SOCKET_NAME.match(self.endpoint) or self.endpoint == KUBELET_SOCKET_NAME:
            raise SettingsError("endpoint", f"{self.endpoint!r} must be a socket file name ending in .sock "
                                            f"(not {KUBELET_SOCKET_NAME})")
        if not self.plugin_dir.is_absolute():
            raise SettingsError("plugin_dir", f"{self.plugin_dir} must be an absolute path")
        if not self.pod_resources_socket.is_absolute():
            raise SettingsError("pod_resources_socket", f"{self.pod_resources_socket} must be an absolute path")
        if len(str(self.socket_path)) > 107:
            raise SettingsError("plugin_dir", f"socket path {self.socket_path} is longer than a unix socket allows")
        if self.kubeconfig is not None and not self.kubeconfig.is_file():
            raise SettingsError("kubeconfig", f"file {self.kubeconfig} does not exist")
        if not 0 <= self.metrics_port <= 65535:
            raise SettingsError("metrics_port", f"must be 0 (off) to 65535, got {self.metrics_port}")
        if not self.metrics_address:
            raise SettingsError("metrics_address", "must not be empty")
        if self.mps_daemons is not None and self.mps_daemons not in MPS_DAEMONS:
            raise SettingsError("mps_daemons", f"must be one of {', '.join(MPS_DAEMONS)}, got {self.mps_daemons!r}")
        if self.budget_evict and not self.use_kube:
            raise SettingsError("budget_evict", "needs the Kubernetes API (it evicts pods); drop --no-kube")
        if not self.proc_root.is_absolute():
            raise SettingsError("proc_root", f"{self.proc_root} must be an absolute path")
        for name in ("dir_poll_s", "register_timeout_s", "rediscover_s", "reconcile_s", "stamp_resync_s",
                     "stamp_backoff_s", "kube_timeout_s", "budget_s", "kubelet_warn_s"):
            value = getattr(self, name)
            if not value > 0:
                raise SettingsError(name, f"must be positive, got {value}")
        if not 0 <= self.preferred_wait_s <= 30:
            raise SettingsError("preferred_wait_s", f"must be 0 to 30 seconds, got {self.preferred_wait_s}")
        if not 0 <= self.preferred_wait_empty_s <= 120:
            raise SettingsError("preferred_wait_empty_s",
                                f"must be 0 to 120 seconds, got {self.preferred_wait_empty_s}")
        if self.stamp_retries < 0:
            raise SettingsError("stamp_retries", f"must not be negative, got {self.stamp_retries}")
        return self


_PATH_FIELDS = frozenset({"topology", "plugin_dir", "pod_resources_socket", "kubeconfig", "mps_root", "proc_root"})


def _coerce(name: str, value: Any, template: Any) -> Any:
    """Convert one flag value to the field's type, or say why not."""
    if name == "cdi_spec_dirs":
        if not isinstance(value, list | tuple) or not all(isinstance(v, str | os.PathLike) for v in value):
            raise SettingsError(name, f"must be a list of directories, got {value!r}")
        return tuple(Path(v) for v in value)
    if name in _PATH_FIELDS:
        if not isinstance(value, str | os.PathLike):
            raise SettingsError(name, f"must be a path, got {value!r}")
        return Path(value)
    if name in ("mps_daemons", "cdi_validate"):
        if name == "cdi_validate" and not isinstance(value, bool):
            raise SettingsError(name, f"must be true or false, got {value!r}")
        if name == "mps_daemons" and value not in MPS_DAEMONS:
            raise SettingsError(name, f"must be one of {', '.join(MPS_DAEMONS)}, got {value!r}")
        return value
    if isinstance(template, bool):
        if not isinstance(value, bool):
            raise SettingsError(name, f"must be true or false, got {value!r}")
        return value
    if isinstance(template, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise SettingsError(name, f"must be an integer, got {value!r}")
        return value
    if isinstance(template, float):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SettingsError(name, f"must be a number, got {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise SettingsError(name, f"must be a string, got {value!r}")
    return value


def load_config_file(path: Path | None) -> Config:
    """The shared versioned config (``gpuslice.config``); errors name ``config.<field path>``.

    Real-node limits apply with either backend: the simulated backend stands in for a GPU node,
    so it accepts only what a real plugin would (S up to 48), not the simulator's milli-GPU.
    """
    if path is None:
        return default_config()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SettingsError("config", f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        return load_config_text(text)
    except ConfigError as exc:
        where, message = exc.errors[0] if exc.errors else ("", str(exc))
        raise SettingsError(f"config.{where}" if where else "config", message) from exc


def build(flags: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Settings:
    """Settings from flags (``None`` = not given) over the config file (``flags['config']``) over defaults.

    The config file carries what the plugin shares with the extender (S, modes, MPS limits); the
    plugin's own knobs are flags, and a flag always wins over the file.
    """
    known = {f.name for f in fields(Settings)} - {"config", "config_file"}
    defaults = Settings(node_name="")
    values: dict[str, Any] = {}
    for key, value in flags.items():
        if value is None or key not in known:
            continue
        values[key] = _coerce(key, value, getattr(defaults, key))
    if not values.get("node_name"):
        values["node_name"] = (env if env is not None else os.environ).get("NODE_NAME", "")
    backend = values.get("backend", defaults.backend)
    if backend not in BACKENDS:
        raise SettingsError("backend", f"must be one of {', '.join(BACKENDS)}, got {backend!r}")
    config_path = flags.get("config")
    config = load_config_file(Path(config_path) if config_path else None)
    values["config"] = config
    values["config_file"] = Path(config_path) if config_path else None
    if flags.get("mps_memory_limit_only") is None:
        values["mps_memory_limit_only"] = config.mps_limits == "memory-only"
    return replace(defaults, **values).validate()
