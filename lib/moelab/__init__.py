"""moelab: a research workbench for MoE inference.

Entropy-guided adaptive-k routing (plan, routing, experts, hf, evaluate, calibrate, compute) and CUDA-graph
memory-pool reuse (graphs, scratch); docs/ARCHITECTURE.md maps the modules. The routing names below
(`moelab.TopK`, `moelab.route`, ...) load `moelab.routing` on first use, so `import moelab.results` does not pull
in torch; other submodules are imported by name (`import moelab.evaluate`).
"""

import importlib

__version__ = "0.1.0"
_ROUTING = ("RoutingPlan", "TopK", "EntropyAdaptiveK", "TopP", "RatioSkip", "route")
_EXPORTS = {name: "moelab.routing" for name in _ROUTING}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'moelab' has no attribute {name!r}")
