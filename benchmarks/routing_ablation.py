"""Ablation of the Triton routing kernel at large T: where its time above a memory-only kernel goes.

The row kernel of `moelab.kernels.routing` (bf16 logits, the launch the per-device table picks) is
compiled again from its source with parts taken out, and timed in a CUDA graph beside the full kernel
and `memory_floor` (moe_kernels.py: read the logits, write a plan of the same size, no work):
  full           the kernel as shipped
  no_selection   each 8-key chunk folded into a running max instead of sorted and merged into the best
                 eight (at launches where the table picks 'rowsort', as at E = 64 and 128, T = 65536 on the
                 H200; rows record it); the split merge and the epilogue stay
  no_exp         exp2 replaced by the identity in the online softmax / entropy sums
  neither        both
The ablated kernels compute wrong plans: this measures time only. Topic `routing-ablation`.

    PYTHONPATH=lib python benchmarks/routing_ablation.py [--tokens 65536] [--experts 64,128]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch

from moelab.results import write_results
from moelab.routing import TopK

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_kernels import copy_bandwidth_gbs, graph_us, memory_floor  # noqa: E402

KERNEL = Path(__file__).resolve().parents[1] / "lib" / "moelab" / "kernels" / "routing.py"
SELECTION = (
    "        k0, k1, k2, k3, k4, k5, k6, k7 = _sort8(k0, k1, k2, k3, k4, k5, k6, k7)\n"
    "        v0, v1, v2, v3, v4, v5, v6, v7 = _top8(v0, v1, v2, v3, v4, v5, v6, v7, k0, k1, k2, k3, k4, k5, k6, k7)",
    "        v0 = tl.maximum(v0, tl.maximum(tl.maximum(tl.maximum(k0, k1), tl.maximum(k2, k3)),\n"
    "                                       tl.maximum(tl.maximum(k4, k5), tl.maximum(k6, k7))))",
)
EXP = [("e = tl.exp2(d * LOG2E)", "e = d"), ("a = tl.exp2(sh * LOG2E)", "a = sh")]
VARIANTS = {"full": [], "no_selection": [SELECTION], "no_exp": EXP, "neither": [SELECTION, *EXP]}


def ablated(name: str, patches: list, folder: Path):
    """The routing module compiled from its source with `patches` (old, new) applied."""
    src = KERNEL.read_text()
    for old, new in patches:
        if src.count(old) != 1:
            raise SystemExit(f"variant {name}: {old.strip()[:60]!r} is not in {KERNEL} exactly once; "
                             "update this script's patches to the kernel's source")
        src = src.replace(old, new)
    path = folder / f"routing_{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"moelab.kernels._ablation_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--experts", default="64,128", help="comma list of E (k = 8)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA: this times GPU kernels")
    bw = copy_bandwidth_gbs()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        mods = {name: ablated(name, patches, Path(tmp)) for name, patches in VARIANTS.items()}
        T, K = args.tokens, 8
        for E in (int(e) for e in args.experts.split(",")):
            n_in = max(1, min(16, -(-3 * l2 // (T * E * 2))))  # inputs rotated past the L2, as moe_kernels
            xs = [torch.randn(T, E, device="cuda").bfloat16() for _ in range(n_in)]
            bound_us = (T * E * 2 + T * K * 8 + T * 8) / (bw * 1e9) * 1e6
            _, _, meta, _ = mods["full"]._shape_launch(T, E, K, 0, tuple(mods["full"].LAUNCH.values()), 2, E)
            sort = bool(meta.get("SORT"))  # no_selection only changes the 'rowsort' chunk step
            calls = {"memory_floor": lambda x: memory_floor(x, K)}
            calls.update({n: (lambda x, m=m: m.route_triton(x, TopK(K), False)) for n, m in mods.items()})
            for name, fn in calls.items():
                us = graph_us(fn, xs, 20)
                rows.append({"E": E, "k": K, "T": T, "variant": name, "graph_us": us, "hbm_bound_us": bound_us,
                             "frac_of_hbm_bound": bound_us / us, "rowsort": sort})
                print(f"E={E:4d} T={T} {name:14s} {us:7.2f} us  {bound_us / us:.3f} of the HBM bound", flush=True)
    notes = ("bf16 logits, native top-8, GPU time per call in a CUDA graph of 20 calls, inputs rotated past 3x L2 "
             "(as benchmarks/moe_kernels.py). Variants of the Triton row kernel compiled from its source with parts "
             "taken out (times only: their plans are wrong); memory_floor: moe_kernels.memory_floor. hbm_bound_us: "
             "logits read + plan written at the measured copy bandwidth.")
    print("wrote", write_results("routing-ablation", rows, notes=notes, extra={"copy_bandwidth_gbs": bw}))


if __name__ == "__main__":
    main()
