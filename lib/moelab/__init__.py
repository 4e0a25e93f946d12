"""moelab: a research workbench for MoE inference.

Entropy-guided adaptive-k routing (routing, compute, experts, hf, evaluate, calibrate) and CUDA-graph
memory pool reuse (graphs). Modules are imported on use; `import moelab` stays cheap.
"""

from moelab.routing import EntropyAdaptiveK, RatioSkip, RoutingPlan, TopK, TopP, route

__version__ = "0.1.0"
__all__ = ["RoutingPlan", "TopK", "EntropyAdaptiveK", "TopP", "RatioSkip", "route"]
