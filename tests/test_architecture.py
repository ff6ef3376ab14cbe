"""The layering rules of DESIGN 1, checked on the real import graph."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN_IN_CORE = ("grpc", "kubernetes", "httpx", "http", "urllib", "requests", "aiohttp", "starlette",
                     "uvicorn", "prometheus_client", "pynvml", "socket", "extender", "deviceplugin", "simulator",
                     "gpuslice_cli")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_core_imports_no_io_library() -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(_imports(path) & set(FORBIDDEN_IN_CORE))
        for path in (ROOT / "gpuslice").rglob("*.py")
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert offenders == {}


def test_importing_the_core_loads_no_io_library() -> None:
    # Modules the interpreter loaded before the core (an editable install's .pth file pulls in
    # urllib.parse through pathlib) are not the core's doing, so only new ones count.
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "import importlib, pkgutil, gpuslice\n"
        "for m in pkgutil.walk_packages(gpuslice.__path__, 'gpuslice.'):\n"
        "    importlib.import_module(m.name)\n"
        f"bad = sorted(n for n in set(sys.modules) - before if n.split('.')[0] in {FORBIDDEN_IN_CORE!r})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == ""


def test_import_contracts_hold() -> None:
    """extender and deviceplugin never import each other; the core imports neither (import-linter)."""
    linter = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(linter)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Contracts: 2 kept, 0 broken" in out.stdout


def test_public_names_resolve() -> None:
    import gpuslice

    assert sorted(gpuslice.__all__) == sorted(set(gpuslice.__all__))
    for name in gpuslice.__all__:
        assert getattr(gpuslice, name) is not None, name
