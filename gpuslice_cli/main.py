"""The ``gpu-slice`` command: the one place that knows every package.

Subcommands are imported only when chosen, so ``gpu-slice simulate`` never loads grpc and the
device plugin never loads matplotlib. A subcommand module exposes ``add_arguments(parser)`` and
``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Protocol, cast

# name -> (module implementing it, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "simulate": ("simulator.cli", "replay a workload through the packing policies and report"),
    "extender": ("extender.cli", "run the kube-scheduler extender (HTTP)"),
    "device-plugin": ("deviceplugin.cli", "run the kubelet device plugin (gRPC)"),
    "mps-daemon": ("deviceplugin.mps_keeper", "keep a node's MPS control daemons (the gpu-slice-mps DaemonSet)"),
    "fake-cluster": ("gpuslice_cli.fake_cluster", "write a v1 List of fake GPU nodes and pods"),
    "status": ("gpuslice_cli.status", "show every GPU's slices, free and stranded capacity, and why pods are Pending"),
}

EXIT_NOT_BUILT = 3


class _Subcommand(Protocol):
    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def _load(name: str) -> _Subcommand | None:
    module_name = SUBCOMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # Only "this subcommand is not built yet" is swallowed; a missing dependency inside a built
        # subcommand must surface as itself.
        if exc.name is not None and module_name.startswith(exc.name):
            return None
        raise
    return cast(_Subcommand, module)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gpu-slice")
    except PackageNotFoundError:
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the subcommand first, import only its module, then parse its own flags."""
    args = list(sys.argv[1:] if argv is None else argv)
    top = argparse.ArgumentParser(
        prog="gpu-slice",
        description="Fractional GPUs for Kubernetes: MIG and MPS slices, packed by a scheduler extender.",
    )
    top.add_argument("--version", action="version", version=f"gpu-slice {_version()}")
    sub = top.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not args or args[0] not in SUBCOMMANDS:
        top.parse_args(args)  # prints help/version or the argparse error for an unknown command
        top.print_help(sys.stderr)
        return 2
    name = args[0]
    module = _load(name)
    if module is None:
        print(f"gpu-slice {name}: not built yet in this version", file=sys.stderr)
        return EXIT_NOT_BUILT
    parser = argparse.ArgumentParser(prog=f"gpu-slice {name}", description=SUBCOMMANDS[name][1])
    module.add_arguments(parser)
    parsed = parser.parse_args(args[1:])
    try:
        return module.run(parsed)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
