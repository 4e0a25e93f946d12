"""The one-way data flow of docs/ARCHITECTURE.md, checked on the source: every moelab import goes to an earlier
layer, except the dispatchers' lazy imports of their own kernels."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import moelab

LIB = Path(moelab.__file__).resolve().parents[1]  # the library these tests import (PYTHONPATH's, as run)

# layer of each module: a module imports only modules of lower layers (ARCHITECTURE.md's flow, bottom up)
LAYER = {
    # utilities and the contract: import no later stage
    "moelab": 0, "moelab.data": 0, "moelab.results": 0, "moelab.scratch": 0, "moelab.kernels": 0, "moelab.params": 0,
    "moelab.plan": 0,
    "moelab.routing": 1, "moelab.tokenizer": 1, "moelab.plots": 1, "moelab.graphs": 1,
    # kernels and the steps that speak the plan
    "moelab.compute": 2, "moelab.experts": 2, "moelab.models": 2, "moelab.kernels.routing": 2,
    "moelab.kernels.experts": 2, "moelab.sweep": 2,
    "moelab.kernels.layout": 3, "moelab.kernels.grouped": 3, "moelab.hf": 3, "moelab.perplexity": 3,
    # evaluation on top, and the trainer that makes the embedded models
    "moelab.evaluate": 4, "moelab.train": 4,
    "moelab.calibrate": 5, "moelab.paper": 6,
}
# dispatchers import the kernels they dispatch to lazily, inside the call that takes them
LAZY_DISPATCH = {
    ("moelab.routing", "moelab.kernels"), ("moelab.routing", "moelab.kernels.routing"),
    ("moelab.experts", "moelab.kernels"), ("moelab.experts", "moelab.kernels.experts"),
    ("moelab.experts", "moelab.kernels.grouped"), ("moelab.experts", "moelab.kernels.layout"),
}


def _module(path: Path) -> str:
    return ".".join(path.relative_to(LIB).with_suffix("").parts).removesuffix(".__init__")


def _imports(path: Path):
    """(imported moelab module, at module level?) for every import statement of one file. At module level: run
    on import, i.e. not inside a function's body (an import in a module-level `if` / `try` block runs on import)."""
    tree = ast.parse(path.read_text())
    lazy = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for n in ast.walk(f) if n is not f}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "moelab":
            names = [f"moelab.{a.name}" for a in node.names] if node.module == "moelab" else [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] == "moelab"]
        else:
            continue
        for name in names:
            yield name, id(node) not in lazy


def test_every_module_has_a_layer():
    found = {_module(p) for p in (LIB / "moelab").rglob("*.py")}
    assert found == set(LAYER), f"place new modules in LAYER: {sorted(found ^ set(LAYER))}"


def test_imports_go_to_earlier_layers_only():
    bad = []
    for path in (LIB / "moelab").rglob("*.py"):
        mod = _module(path)
        for name, top in _imports(path):
            if name not in LAYER:  # `from moelab.x import y` of a function y names module x
                continue
            if (mod, name) in LAZY_DISPATCH and not top:
                continue
            if LAYER[name] >= LAYER[mod] and name != mod:
                bad.append(f"{mod} (layer {LAYER[mod]}) imports {name} (layer {LAYER[name]})")
    assert not bad, "imports against the one-way flow:\n" + "\n".join(bad)


def test_dispatch_imports_are_lazy():
    """`import moelab.routing` / `moelab.experts` must not need Triton: their kernel imports sit inside calls."""
    for mod in ("routing", "experts"):
        tops = [n for n, top in _imports(LIB / "moelab" / f"{mod}.py") if top and n.startswith("moelab.kernels")]
        assert not tops, f"moelab.{mod} imports {tops} at module level"


def test_importing_the_dispatchers_loads_no_kernel_module():
    """The same, by importing them in a fresh interpreter: neither Triton nor any moelab.kernels module is loaded
    (also not by an import that hides from the source check, e.g. in a module-level block or another module)."""
    code = ("import sys, moelab.routing, moelab.experts; "
            "print(sorted(m for m in sys.modules if m == 'triton' or m.startswith(('triton.', 'moelab.kernels'))))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(LIB), os.environ.get("PYTHONPATH"))))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         env=env)
    assert out.stdout.strip() == "[]", f"import moelab.routing, moelab.experts loaded {out.stdout.strip()}"
