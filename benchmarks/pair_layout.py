"""GPU time of the padded pair layout (`moelab.kernels.layout.pair_layout_padded`) across E, k and T.

The layout sorts a routing plan's kept (token, expert) pairs by expert for the grouped GEMMs, without a
host sync: per-block expert counts, a scan over the blocks, a per-block sort and scatter. Timed as GPU
time per call in a CUDA graph of 10 calls (do_bench median of replays), on the native top-k plan and
the entropy-adaptive plan (terciles of a 4096-token calibration batch) of random bf16 logits; `bytes`
counts what one call must read (the plan's ids and weights) and write (token, expert, weight per row,
the slot map, the group ends).
Topic `pair-layout`.

    PYTHONPATH=lib python benchmarks/pair_layout.py [--tokens 1,16,512,4096,65536]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from moelab.kernels.layout import pair_layout_padded
from moelab.kernels.routing import route_triton
from moelab.results import write_results
from moelab.routing import TopK

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_kernels import adaptive_policy, copy_bandwidth_gbs, graph_us  # noqa: E402

SHAPES = {"mixtral": (8, 2), "qwen15": (60, 4), "olmoe": (64, 8), "e128": (128, 8), "e256": (256, 8)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,16,512,4096,65536", help="comma list of T")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA: this times GPU kernels")
    bw = copy_bandwidth_gbs()
    rows = []
    for name, (E, k) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(E)
        calib = route_triton(torch.randn(4096, E, device="cuda", generator=g).bfloat16(), TopK(k), False)
        ada = adaptive_policy(calib.entropy, k)  # thresholds from a 4096-token batch, as the routing benchmark
        for T in (int(t) for t in args.tokens.split(",")):
            logits = torch.randn(T, E, device="cuda", generator=g).bfloat16()
            plans = {"native": route_triton(logits, TopK(k), False), "adaptive": route_triton(logits, ada, False)}
            for plan_name, plan in plans.items():
                us = graph_us(lambda _, plan=plan: pair_layout_padded(plan), [None], 10)
                nbytes = T * k * (4 + 4) + T * k * (8 + 8 + 4) + T * k * 4 + E * 4
                rows.append({"shape": name, "E": E, "k": k, "T": T, "plan": plan_name,
                             "kept_pairs": int(plan.k.sum()), "graph_us": us, "bytes": nbytes,
                             "copy_us": nbytes / (bw * 1e9) * 1e6})
                print(f"layout {name:8s} E={E:3d} k={k} T={T:6d} {plan_name:8s} {us:8.1f} us", flush=True)
    notes = ("pair_layout_padded on routing plans of random bf16 logits (native top-k; adaptive: (k/4, k/2, k) at "
             "the entropy terciles of a 4096-token calibration batch), GPU time per call in a CUDA graph of 10 "
             "calls (do_bench median of replays, L2 flushed before each replay). bytes: plan ids and weights "
             "read, token / expert / weight per row, the slot map and the group ends written; copy_us: those "
             "bytes at the measured copy bandwidth.")
    print("wrote", write_results("pair-layout", rows, notes=notes, extra={"copy_bandwidth_gbs": bw}))


if __name__ == "__main__":
    main()
