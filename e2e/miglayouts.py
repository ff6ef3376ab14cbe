"""Helpers of the dynamic-MIG-layout scenario (``test_9z_mig_layouts.py``): a node of its own, and the
extenders and that node's plugin run with ``migLayouts.H100-80GB.dynamic: true`` for the scenario only.

The session's three nodes and its shipped config stay as they are for every other scenario: the
extra node joins for this scenario and leaves after it (kubelet-dm stopped, the Node deleted), and
the extenders go back to the shipped config.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import yaml

from e2e.harness import System, cluster, http, tail, wait

NODE = "gpu-recut"
TOPOLOGY: dict[str, Any] = {"version": 1, "node": NODE, "gpus": [
    {"product": "H100-80GB", "mode": "mig", "instances": [{"profile": "1g.10gb", "start": s} for s in range(7)]}]}
DYNAMIC = {"migLayouts": {"H100-80GB": {"dynamic": True}}}


def _with_dynamic(text: str) -> str:
    doc = yaml.safe_load(text) or {}
    doc.update(DYNAMIC)
    return yaml.safe_dump(doc, sort_keys=False)


def _restart_extenders(system: System) -> None:
    for r in system.replicas:
        r.extender.stop()
        r.extender.start()
        url = f"{r.ops_url}/healthz"
        wait(f"{r.extender.name} /healthz", lambda r=r, url=url: (r.extender.check(), http("GET", url)[0] == 200)[1],
             60, on_timeout=lambda r=r: tail(r.extender.log))
    system.wait_leader()


@contextlib.contextmanager
def dynamic_node(system: System) -> Iterator[str]:
    """The node ``gpu-recut`` (one H100, seven 1g.10gb), with dynamic layouts on; all undone after."""
    shipped = system.extender_config.read_text()
    config = system.work / "plugin-config-dynamic.yaml"
    config.write_text(_with_dynamic(system.plugin_config.read_text()))
    system.extender_config.write_text(_with_dynamic(shipped))
    try:
        _restart_extenders(system)
        system._start_node(NODE, TOPOLOGY, config=config)
        system._wait_node_ready(system.nodes[NODE], slices=7)
        yield NODE
    finally:
        node = system.nodes.pop(NODE, None)
        for proc in (node.plugin, node.mps) if node is not None else ():
            if proc is not None:
                proc.stop()
                with contextlib.suppress(Exception):
                    system.procs.remove(proc)
        with contextlib.suppress(Exception):
            cluster("stop", str(system.work), f"node-{NODE}")
        with contextlib.suppress(Exception):
            system.kube.core.delete_node(NODE)
        system.extender_config.write_text(shipped)
        _restart_extenders(system)
