"""The one-way flow of docs/ARCHITECTURE.md, checked on the source: every moelab import, lazy ones inside
functions included, goes to a lower layer, so no module imports one that imports it back."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import moelab

LIB = Path(moelab.__file__).resolve().parents[1]  # the library these tests import (PYTHONPATH's, as run)

# a module imports only modules of lower layers (docs/ARCHITECTURE.md, bottom up)
LAYER = {
    # contract and utilities: no moelab import beyond each other
    "moelab.plan": 0, "moelab.params": 0, "moelab.results": 0, "moelab.data": 0,
    "moelab.plots": 1, "moelab.scratch": 1, "moelab.sweep": 2,
    # kernels: the contract and their own launch helpers only
    "moelab.kernels": 1, "moelab.kernels.experts": 2, "moelab.kernels.routing": 2, "moelab.kernels.layout": 2,
    "moelab.kernels.grouped": 3,
    # dispatch, then models, then measurement
    "moelab.routing": 4, "moelab.experts": 4,
    "moelab.compute": 5, "moelab.models": 5, "moelab.graphs": 5,
    "moelab.hf": 6,
    "moelab.evaluate": 7, "moelab.calibrate": 8, "moelab.paper": 9,
    "moelab": 10,  # the package's lazy re-exports
}


def _module(path: Path) -> str:
    return ".".join(path.relative_to(LIB).with_suffix("").parts).removesuffix(".__init__")


def _imports(path: Path):
    """(imported moelab module, at module level?) for every import statement of one file, and the targets of
    `importlib.import_module("moelab...")` calls with a literal name."""
    tree = ast.parse(path.read_text())
    lazy = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for n in ast.walk(f) if n is not f}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "moelab":
            base = node.module
            names = [base + "." + a.name if base + "." + a.name in LAYER else base for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] == "moelab"]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("moelab")):
            names = [node.args[0].value]
        else:
            continue
        for name in names:
            yield name, id(node) not in lazy


def _edges() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for path in (LIB / "moelab").rglob("*.py"):
        mod = _module(path)
        out[mod] = {n for n, _ in _imports(path) if n != mod}
    return out


def test_every_module_has_a_layer():
    found = {_module(p) for p in (LIB / "moelab").rglob("*.py")}
    assert found == set(LAYER), f"place new modules in LAYER: {sorted(found ^ set(LAYER))}"


def test_imports_go_to_lower_layers_only_lazy_ones_included():
    bad = [f"{mod} (layer {LAYER[mod]}) imports {name} (layer {LAYER.get(name)})"
           for mod, names in _edges().items() for name in names if LAYER.get(name, 99) >= LAYER[mod]]
    assert not bad, "imports against the one-way flow:\n" + "\n".join(sorted(bad))


def test_no_import_cycles():
    edges = _edges()
    state: dict[str, int] = {}

    def visit(m, stack):
        state[m] = 1
        for n in edges.get(m, ()):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in edges:
        if m not in state:
            visit(m, [m])


def test_kernels_import_only_the_contract():
    for path in (LIB / "moelab" / "kernels").rglob("*.py"):
        bad = [n for n, _ in _imports(path) if n != "moelab.plan" and not n.startswith("moelab.kernels")]
        assert not bad, f"{_module(path)} imports {bad}: kernels import only moelab.plan and moelab.kernels"


def test_importing_the_dispatchers_loads_no_kernel_module():
    """`import moelab.routing, moelab.experts` must not need Triton: their kernel imports sit inside calls."""
    code = ("import sys, moelab.routing, moelab.experts; "
            "print(sorted(m for m in sys.modules if m == 'triton' or m.startswith(('triton.', 'moelab.kernels'))))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(LIB), os.environ.get("PYTHONPATH"))))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         env=env)
    assert out.stdout.strip() == "[]", f"import moelab.routing, moelab.experts loaded {out.stdout.strip()}"
