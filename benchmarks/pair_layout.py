"""GPU time of the padded pair layout (`moelab.kernels.layout.pair_layout_padded`) across E, k and T.

The layout sorts a routing plan's kept (token, expert) pairs by expert for the grouped GEMMs, without a
host sync: per-block expert counts, a scan over the blocks, a per-block sort and scatter. Timed as GPU
time per call in a CUDA graph of 10 calls (do_bench median of replays), on the native top-k plan and
the entropy-adaptive plan (terciles of a 4096-token calibration batch) of random bf16 logits; `bytes`
counts what one call must read (the plan's ids and weights) and write (token, expert, weight per row,
the slot map, the group ends).
Topic `pair-layout`.

`--sweep` times the launch configurations instead (topic `pair-layout-sweep`): plan slots per block Q =
128-1024 and 1-8 warps (1-8 slots per thread) on the native plan of each shape, every layout checked equal
to the rule's bit for bit; each row says whether it is the rule's pick (`moelab.kernels.layout.launch_config`)
and its time over the fastest configuration of its point.

    PYTHONPATH=lib python benchmarks/pair_layout.py [--tokens 1,16,512,4096,65536] [--sweep]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import moelab.kernels.layout as lk
from moelab.kernels.layout import pair_layout_padded
from moelab.kernels.routing import route_triton
from moelab.results import write_results
from moelab.routing import TopK

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_kernels import adaptive_policy, copy_bandwidth_gbs, graph_us, ints_at_least  # noqa: E402

SHAPES = {"mixtral": (8, 2), "qwen15": (60, 4), "olmoe": (64, 8), "e128": (128, 8), "e256": (256, 8)}
# (Q, warps) swept: 1-8 plan slots per thread
SWEEP = [(q, w) for q in (128, 256, 512, 1024) for w in (1, 2, 4, 8) if 32 * w <= q <= 256 * w]
FIELDS = ("token_idx", "expert_idx", "weights", "offsets", "slot_row")


def sweep(tokens: list[int], bw: float) -> None:
    """Every (Q, warps) of SWEEP at each shape and T on the native plan, beside the rule's pick."""
    rows = []
    for name, (E, k) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(E)
        for T in tokens:
            plan = route_triton(torch.randn(T, E, device="cuda", generator=g).bfloat16(), TopK(k), False)
            rule = lk.launch_config(T * k, E)
            ref = pair_layout_padded(plan)
            point = []
            for q, warps in SWEEP:
                lk.LAUNCH.update(block_slots=q, warps=warps)
                try:
                    got = pair_layout_padded(plan)
                    for f in FIELDS:
                        if not torch.equal(getattr(got, f), getattr(ref, f)):
                            raise SystemExit(f"{name} T={T} Q={q} warps={warps}: {f} differs from the rule's layout")
                    us = graph_us(lambda _, plan=plan: pair_layout_padded(plan), [None], 10)
                    q_used = lk.launch_config(T * k, E)[0]  # Q cut to the slots there are
                finally:
                    lk.LAUNCH.update(block_slots=None, warps=None)
                point.append({"shape": name, "E": E, "k": k, "T": T, "block_slots": q, "block_slots_used": q_used,
                              "warps": warps, "graph_us": us, "rule_pick": (q_used, warps) == rule[:2],
                              "rule_block_slots": rule[0], "rule_warps": rule[1]})
            best = min(r["graph_us"] for r in point)
            for r in point:
                r["over_fastest"] = r["graph_us"] / best
            pick = [r for r in point if r["rule_pick"]]
            print(f"sweep {name:8s} E={E:3d} T={T:6d} fastest {best:6.1f} us, rule Q={rule[0]} w={rule[1]} "
                  f"{pick[0]['graph_us'] if pick else float('nan'):6.1f} us", flush=True)
            rows += point
            path = write_results("pair-layout-sweep", rows, notes=SWEEP_NOTES, extra={"copy_bandwidth_gbs": bw})
    print("wrote", path)  # after every point: a run stopped early keeps the points it finished


SWEEP_NOTES = ("pair_layout_padded on the native top-k plan of random bf16 logits, GPU time per call in a CUDA graph "
               "of 10 calls (do_bench median of replays, L2 flushed before each replay), per launch configuration: "
               "block_slots Q (plan slots per block; block_slots_used: Q cut to the slots there are), warps of the "
               "count and scatter programs; scan tiles of the rule. rule_pick: the configuration moelab.kernels.layout."
               "launch_config takes; over_fastest: time / the fastest configuration of the same shape and T.")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=ints_at_least(1), default="1,16,512,4096,65536", help="comma list of T")
    ap.add_argument("--sweep", action="store_true", help="time every (Q, warps) of SWEEP (topic pair-layout-sweep)")
    args = ap.parse_args()
    tokens = args.tokens
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA: this times GPU kernels")
    bw = copy_bandwidth_gbs()
    if args.sweep:
        return sweep(tokens, bw)
    rows = []
    for name, (E, k) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(E)
        calib = route_triton(torch.randn(4096, E, device="cuda", generator=g).bfloat16(), TopK(k), False)
        ada = adaptive_policy(calib.entropy, k)  # thresholds from a 4096-token batch, as the routing benchmark
        for T in tokens:
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
