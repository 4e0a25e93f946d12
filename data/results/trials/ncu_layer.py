"""Trial (data/results/trials/README.md): the OLMoE-like layer eagerly, native twice then the terciles policy twice, batch 0, for ncu."""
import sys
import torch
sys.path.insert(0, "benchmarks")
from moe_kernels import LAYERS, hf_block, moelab_layer, layer_policies, layer_input
D, Fd, E, k, renorm, shared = LAYERS["olmoe"]
block, cfg = hf_block("olmoe", D, Fd, E, k, shared, "cuda")
ours = moelab_layer(block, renorm, shared)
pols = layer_policies(block, k, renorm, D)
import os  # BX=1: gate_up with BY_EXPERT (the trial at 774b68a; main has no BY_EXPERT)
from moelab.kernels import grouped
if os.environ.get("BX"):
    grouped.TUNED["NVIDIA H200"][(2048, 1024)][0][1]["gate_up"]["BY_EXPERT"] = True
    grouped._launch_config.cache_clear()
x = layer_input(4096, D, 0)
for p in ("native", "adaptive"):
    for _ in range(2):
        ours(x, pols[p])
torch.cuda.synchronize()
print("done")
