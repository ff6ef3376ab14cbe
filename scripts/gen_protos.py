#!/usr/bin/env python3
"""Regenerate the checked-in Python code for the kubelet protos.

The generated modules live in ``deviceplugin/_proto/`` and are committed, so the
runtime never needs grpcio-tools. This script is the one way to produce them:

    python scripts/gen_protos.py           # rewrite deviceplugin/_proto/
    python scripts/gen_protos.py --check   # CI: exit 1 if the checked-in code is stale

protoc writes absolute imports such as ``from deviceplugin.v1beta1 import api_pb2``
(the path relative to ``protos/``); inside our package that would resolve to the
product package ``deviceplugin``, so they are rewritten to relative imports.
"""

from __future__ import annotations

import argparse
import difflib
import filecmp
import keyword
import re
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from google.protobuf import descriptor_pb2

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "protos"
OUT_DIR = REPO / "deviceplugin" / "_proto"
OUT_PACKAGE = "deviceplugin._proto"
PROTOS = ("deviceplugin/v1beta1/api.proto", "podresources/v1/api.proto")

PACKAGE_DOC = {
    "": "Generated kubelet gRPC code; see scripts/gen_protos.py. Do not edit.",
    "deviceplugin": "Generated from protos/deviceplugin; do not edit.",
    "deviceplugin/v1beta1": "kubelet device plugin API v1beta1 (generated; do not edit).",
    "podresources": "Generated from protos/podresources; do not edit.",
    "podresources/v1": "kubelet PodResources API v1 (generated; do not edit).",
}

_IMPORT_RE = re.compile(r"^from (?P<mod>[\w.]+) import (?P<name>\w+_pb2) as (?P<alias>\w+)$", re.MULTILINE)


def _tools_version() -> str:
    return metadata.version("grpcio-tools")


def _relative_import(this_dir: tuple[str, ...], target_dir: tuple[str, ...]) -> str:
    """The relative module prefix that reaches target_dir from a module in this_dir."""
    common = 0
    while common < min(len(this_dir), len(target_dir)) and this_dir[common] == target_dir[common]:
        common += 1
    dots = "." * (len(this_dir) - common + 1)
    return dots + ".".join(target_dir[common:])


def _fix_imports(path: Path, rel_dir: tuple[str, ...], generated_dirs: set[tuple[str, ...]]) -> None:
    """Rewrite protoc's absolute imports of sibling generated modules as relative ones."""
    text = path.read_text()

    def repl(m: re.Match[str]) -> str:
        target = tuple(m["mod"].split("."))
        if target not in generated_dirs:
            return m.group(0)  # e.g. google.protobuf: leave alone
        return f"from {_relative_import(rel_dir, target)} import {m['name']} as {m['alias']}"

    path.write_text(_IMPORT_RE.sub(repl, text))


def generate(out: Path) -> None:
    """Run protoc into ``out`` and post-process the result into an importable package."""
    with tempfile.TemporaryDirectory(prefix="gen_protos_fds_") as fds_dir:
        fds_path = Path(fds_dir) / "protos.fds"
        cmd = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            f"--descriptor_set_out={fds_path}",
            *PROTOS,
        ]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"protoc failed ({proc.returncode}):\n{proc.stderr}")
        fds = descriptor_pb2.FileDescriptorSet.FromString(fds_path.read_bytes())
    for file in fds.file:
        if file.service:
            stub = out / Path(file.name).with_name(Path(file.name).stem + "_pb2_grpc.pyi")
            stub.write_text(grpc_stub(file))

    generated_dirs = {tuple(Path(p).parent.parts) for p in PROTOS}
    header = f"# Checked in; regenerate with scripts/gen_protos.py (grpcio-tools {_tools_version()}).\n"
    for path in sorted(out.rglob("*.py*")):
        rel_dir = tuple(path.parent.relative_to(out).parts)
        if path.name.endswith("_pb2_grpc.py"):
            _fix_imports(path, rel_dir, generated_dirs)
        path.write_text(header + path.read_text())

    for rel, doc in PACKAGE_DOC.items():
        pkg = out / rel
        pkg.mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").write_text(f'"""{doc}"""\n')


def grpc_stub(file: descriptor_pb2.FileDescriptorProto) -> str:
    """A typed .pyi for one generated *_pb2_grpc.py (grpc_tools writes none).

    Stubs are typed for both channel kinds (``__new__`` overloads return a sync or an
    ``AsyncStub`` view), and servicer methods accept grpc or grpc.aio implementations,
    as mypy-protobuf does; the module's experimental static-call classes are left out.
    """
    pb2 = Path(file.name).stem + "_pb2"

    def msg(type_name: str) -> str:
        prefix = f".{file.package}."
        if not type_name.startswith(prefix) or "." in type_name[len(prefix) :]:
            raise SystemExit(f"{file.name}: only top-level messages of the same file are supported: {type_name}")
        return f"_pb2.{type_name[len(prefix) :]}"

    lines = [
        f'"""Typed view of {pb2}_grpc.py (written by scripts/gen_protos.py from {file.name})."""',
        "",
        "import collections.abc",
        "import typing",
        "",
        "import grpc",
        "import grpc.aio",
        "",
        f"from . import {pb2} as _pb2",
        "",
        "GRPC_GENERATED_VERSION: str",
        "GRPC_VERSION: str",
        "",
        "class _ServicerContext(grpc.ServicerContext, grpc.aio.ServicerContext):  # type: ignore[misc, type-arg]",
        '    """Either context, so servicers may be written for grpc or for grpc.aio."""',
    ]
    for service in file.service:
        name = service.name
        sync_attrs, async_attrs, servicer = [], [], []
        for m in service.method:
            if m.client_streaming:
                raise SystemExit(f"{file.name}: client streaming is not supported by this generator")
            req, resp = msg(m.input_type), msg(m.output_type)
            kind = "UnaryStream" if m.server_streaming else "UnaryUnary"
            attr = m.name + ("_" if keyword.iskeyword(m.name) else "")
            sync_attrs.append(f"    {attr}: grpc.{kind}MultiCallable[{req}, {resp}]")
            async_attrs.append(f"    {attr}: grpc.aio.{kind}MultiCallable[{req}, {resp}]")
            if m.server_streaming:
                ret = f"collections.abc.Iterator[{resp}] | collections.abc.AsyncIterator[{resp}]"
            else:
                ret = f"{resp} | collections.abc.Awaitable[{resp}]"
            servicer.append(f"    def {attr}(self, request: {req}, context: _ServicerContext) -> {ret}: ...")
        lines += [
            "",
            f"class {name}Stub:",
            "    @typing.overload",
            f"    def __new__(cls, channel: grpc.Channel) -> {name}Stub: ...",
            "    @typing.overload",
            f"    def __new__(cls, channel: grpc.aio.Channel) -> {name}AsyncStub: ...",
            *sync_attrs,
            "",
            f"class {name}AsyncStub:",
            f'    """Typing only: what {name}Stub is over a grpc.aio channel."""',
            *async_attrs,
            "",
            f"class {name}Servicer:",
            *servicer,
            "",
            f"def add_{name}Servicer_to_server(",
            f"    servicer: {name}Servicer, server: grpc.Server | grpc.aio.Server",
            ") -> None: ...",
        ]
    return "\n".join(lines) + "\n"


def _tree(root: Path) -> set[Path]:
    return {
        p.relative_to(root)
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


def check(fresh: Path) -> int:
    """Compare a fresh generation with the checked-in tree; report and return an exit code."""
    have = _tree(OUT_DIR) if OUT_DIR.exists() else set()
    want = _tree(fresh)
    problems: list[str] = []
    for rel in sorted(want - have):
        problems.append(f"missing: {OUT_DIR.name}/{rel}")
    for rel in sorted(have - want):
        problems.append(f"stale (not generated any more): {OUT_DIR.name}/{rel}")
    for rel in sorted(want & have):
        a, b = OUT_DIR / rel, fresh / rel
        if filecmp.cmp(a, b, shallow=False):
            continue
        diff = difflib.unified_diff(
            a.read_text().splitlines(),
            b.read_text().splitlines(),
            f"checked-in/{rel}",
            f"regenerated/{rel}",
            lineterm="",
            n=1,
        )
        problems.append(f"differs: {OUT_DIR.name}/{rel}\n" + "\n".join(list(diff)[:40]))
    if not problems:
        print(f"{OUT_PACKAGE} is up to date (grpcio-tools {_tools_version()}).")
        return 0
    print("\n".join(problems), file=sys.stderr)
    print(
        f"\n{OUT_PACKAGE} is out of date with protos/ (or was generated with another grpcio-tools; "
        f"this one is {_tools_version()}). Run: python scripts/gen_protos.py",
        file=sys.stderr,
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="regenerate into a temp dir and diff; change nothing")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gen_protos_") as tmp:
        fresh = Path(tmp)
        generate(fresh)
        if args.check:
            return check(fresh)
        if OUT_DIR.exists():
            shutil.rmtree(OUT_DIR)
        shutil.copytree(fresh, OUT_DIR)
    print(f"wrote {OUT_DIR.relative_to(REPO)}/ from {', '.join(PROTOS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
