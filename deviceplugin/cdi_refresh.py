"""CDI names for MIG instances a re-cut created: regenerate the toolkit's spec, then check it.

The NVIDIA Container Toolkit writes its CDI spec (kind ``nvidia.com/gpu``) at install, or at boot
with v1.18's ``nvidia-cdi-refresh``: it names the MIG instances that existed then. A re-cut creates
instances with new UUIDs, whose names (``nvidia.com/gpu=MIG-<uuid>``) the runtime cannot resolve
until the spec is generated again. The toolkit knows what a MIG device needs in a container (its
``/dev/nvidia-caps`` GPU- and compute-instance capability nodes, the driver libraries, the ldcache
hook), so the plugin does not write a spec of its own: it runs the toolkit's generator
(``nvidia-ctk cdi generate``, the ``--cdi-refresh-command``) after every re-cut on NVML, and before
the new ids are advertised, then reads the spec back and refuses to advertise an instance the spec
does not name. The runtime (containerd, CRI-O) re-reads spec files when it injects devices.
"""

from __future__ import annotations

import logging
import shlex
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

from deviceplugin.cdi import read_specs
from deviceplugin.errors import RecutFailed

log = logging.getLogger(__name__)

#: The toolkit's own generator, writing where v1.18's ``nvidia-cdi-refresh`` writes (names by UUID
#: and by index, the toolkit's default strategies; the plugin hands out UUID names).
DEFAULT_COMMAND = "nvidia-ctk cdi generate --output=/var/run/cdi/nvidia.yaml"
TIMEOUT_S = 120.0


class CdiRefresher:
    """Runs the spec generator and checks that the spec names every UUID asked for."""

    def __init__(self, command: str, vendor: str, class_: str, spec_dirs: Sequence[Path]) -> None:
        self.argv = shlex.split(command)
        self.vendor = vendor
        self.class_ = class_
        self.spec_dirs = tuple(spec_dirs)

    def refresh(self, uuids: Iterable[str]) -> Path:
        """Regenerate the spec; return it. ``RecutFailed`` when the command fails or a UUID is not named."""
        wanted = list(uuids)
        if not self.argv:
            raise RecutFailed("no --cdi-refresh-command: the CDI spec cannot name the new MIG instances "
                              f"{', '.join(wanted)}, so they are not advertised")
        try:
            done = subprocess.run(self.argv, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RecutFailed(f"CDI refresh {' '.join(self.argv)!r} could not run: {exc}") from exc
        if done.returncode != 0:
            raise RecutFailed(f"CDI refresh {' '.join(self.argv)!r} exited {done.returncode}: "
                              f"{(done.stderr or done.stdout).strip()[-400:]}")
        specs = read_specs(self.vendor, self.class_, self.spec_dirs)
        if not specs.paths:
            raise RecutFailed(f"after {' '.join(self.argv)!r} no CDI spec of kind {specs.kind} is in "
                              f"{', '.join(str(d) for d in self.spec_dirs)}")
        missing = [u for u in wanted if u not in specs.names]
        if missing:
            raise RecutFailed(f"the CDI specs {', '.join(str(p) for p in specs.paths)} do not name "
                              f"{', '.join(missing)} after {' '.join(self.argv)!r}")
        spec = specs.paths[0]
        log.info("CDI spec %s names the new MIG instances %s", spec, ", ".join(wanted))
        return spec
