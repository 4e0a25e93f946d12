"""Where the MoE layer's time goes, stage by stage, with native top-k and with adaptive-k plans.

The layer-time target asks that the adaptive layer take at most 1.1 x (kept / native pairs) of the
native layer's time. This times each step of moelab's layer on its own, on the plans of the
layer benchmark (same shapes, seeded weights, same policies), so the part of the layer that does not
shrink with the kept pairs shows. Two expert paths (`--gemms`): 'grouped' (torch._grouped_mm, as
`set_gemm('grouped')` runs it), whose steps are

  router    F.linear(x, w_router)                 [T, E]
  routing   route_triton                          plan
  layout    pair_layout_padded                    expert-sorted rows, T * k_max
  gather    gather_rows                           x rows of the kept pairs
  gate_up   torch._grouped_mm                     [P, 2F]
  swiglu    swiglu_rows                           [P, F]
  down      torch._grouped_mm                     [P, D]
  combine   combine_rows                          [T, D]
  shared    the shared expert and its gate (qwen15)
  layer     the whole layer, one call

and 'triton' (moelab.kernels.grouped, as `set_gemm('triton')` runs it), where gate_up is one kernel
that gathers the rows and applies SwiGLU, so there is no gather or swiglu step; and for both, two
references per expert GEMM: `dense_*`, one plain GEMM of the same P rows against one expert's
weights (what the GEMM costs without grouping: no per-expert tile rounding, weights read once), and
`weights_read_us`, all experts' weights read once at the measured copy bandwidth (what grouping costs
at least, whatever P is). Two times per stage: `time_us`, the eager call's CUDA-event median
(triton.testing.do_bench, L2 flushed), where a short stage shows its host launch time rather than
its GPU work (the GPU waits for the host); and `graph_us`, GPU time per call in a CUDA graph of
GRAPH_CALLS calls (do_bench median of replays, L2 flushed before each replay, so the later calls
find their small inputs in L2 as they would after the previous stage). Topic `layer-stages`.

    PYTHONPATH=lib python benchmarks/layer_stages.py [--tokens 4096] [--shapes mixtral,olmoe,qwen15]
        [--gemms grouped,triton]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from moelab.kernels import grouped as gk
from moelab.kernels.experts import combine_rows, gather_rows, swiglu_rows
from moelab.kernels.layout import pair_layout_padded
from moelab.kernels.routing import route_triton
from moelab.results import write_results

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_kernels import (  # noqa: E402
    LAYERS,
    copy_bandwidth_gbs,
    events_us,
    gemm_tiles,
    graph_us,
    hf_block,
    ints_at_least,
    layer_input,
    layer_policies,
    moelab_layer,
)

GRAPH_CALLS = 10  # calls per captured graph (graph_us)
GEMMS = ("grouped", "triton")  # expert paths timed: torch._grouped_mm (CUTLASS) and moelab's Triton GEMMs


def stage_calls(x, block, layer, pol, renorm, shared, gemm="grouped"):
    """(stage name -> call, the plan, its kept pairs P) for one policy: every stage's inputs made once.
    gemm 'grouped': gather, torch._grouped_mm, SwiGLU, torch._grouped_mm; 'triton': moelab.kernels.grouped's
    two GEMMs (gate_up with the gather and SwiGLU fused) in the device's tuned configuration."""
    gu, dn, wr = block.experts.gate_up_proj, block.experts.down_proj, block.gate.weight
    logits = F.linear(x, wr)
    plan = route_triton(logits, pol, renorm)
    lay = pair_layout_padded(plan)
    offs = lay.offsets
    P = int(offs[-1])
    x_PD = gather_rows(x, lay.token_idx, offs)
    h_PH = torch._grouped_mm(x_PD, gu.transpose(1, 2), offs=offs)
    a_PF = swiglu_rows(h_PH, offs)
    y_PD = torch._grouped_mm(a_PF, dn.transpose(1, 2), offs=offs)
    calls = {
        "router": lambda: F.linear(x, wr),
        "routing": lambda: route_triton(logits, pol, renorm),
        "layout": lambda: pair_layout_padded(plan),
    }
    if gemm == "triton":
        cfg = gk.launch_config(lay.token_idx.shape[0], gu.shape[0], gu.shape[2], dn.shape[2], x.device)
        calls["gate_up"] = lambda: gk.gate_up_swiglu(x, lay.token_idx, offs, gu, cfg["gate_up"])
        calls["down"] = lambda: gk.down_proj(a_PF, offs, dn, cfg["down"])
    else:
        calls["gather"] = lambda: gather_rows(x, lay.token_idx, offs)
        calls["gate_up"] = lambda: torch._grouped_mm(x_PD, gu.transpose(1, 2), offs=offs)
        calls["swiglu"] = lambda: swiglu_rows(h_PH, offs)
        calls["down"] = lambda: torch._grouped_mm(a_PF, dn.transpose(1, 2), offs=offs)
    calls["combine"] = lambda: combine_rows(y_PD, lay.slot_row, plan, x.dtype)
    if shared:
        calls["shared"] = lambda: torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    calls["layer"] = lambda: layer(x, pol)
    # references for the expert GEMMs: the same P rows through one expert's weights, one dense GEMM
    calls["dense_gate_up"] = lambda: x_PD[:P] @ gu[0].T
    calls["dense_down"] = lambda: a_PF[:P] @ dn[0].T
    return calls, plan, P


@torch.no_grad()
def stages_one(name, T, bw, gemms=GEMMS):
    D, Fd, E, k, renorm, shared = LAYERS[name]
    block, _ = hf_block(name, D, Fd, E, k, shared, "cuda")
    pols = layer_policies(block, k, renorm, D)
    pols.pop("adaptive_q25")
    x = layer_input(T, D)  # the layer benchmark's batch 0 at this T
    gu, dn = block.experts.gate_up_proj, block.experts.down_proj
    weights_us = {"gate_up": gu.numel() * gu.element_size() / (bw * 1e9) * 1e6,
                  "down": dn.numel() * dn.element_size() / (bw * 1e9) * 1e6}
    rows = []
    for gemm in gemms:
        layer = moelab_layer(block, renorm, shared, gemm=gemm)
        for plan_name, pol in pols.items():
            calls, plan, P = stage_calls(x, block, layer, pol, renorm, shared, gemm)
            base = {"shape": name, "D": D, "F": Fd, "E": E, "native_k": k, "T": T, "gemm": gemm, "plan": plan_name,
                    "policy": repr(pol), "kept_pairs": P, "native_pairs": T * k,
                    "gemm_tiles_128": gemm_tiles(plan, 128)}
            for stage, fn in calls.items():
                us = events_us(fn)
                gus = graph_us(lambda _, fn=fn: fn(), [None], GRAPH_CALLS)
                row = {**base, "stage": stage, "time_us": us, "graph_us": gus}
                if stage in weights_us:
                    row["weights_read_us"] = weights_us[stage]
                rows.append(row)
                print(f"stages {name:8s} T={T:5d} {gemm:8s} {plan_name:13s} {stage:14s} {us:9.1f} us eager "
                      f"{gus:9.1f} us graph", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=ints_at_least(1), default="4096", help="comma list of T")
    ap.add_argument("--shapes", default=",".join(LAYERS), help=f"comma list of: {', '.join(LAYERS)}")
    ap.add_argument("--gemms", default=",".join(GEMMS), help=f"comma list of expert paths: {', '.join(GEMMS)}")
    args = ap.parse_args()
    shapes = args.shapes.split(",")
    bad = [s for s in shapes if s not in LAYERS]
    if bad:
        ap.error(f"argument --shapes: {','.join(bad)}: must be among {', '.join(LAYERS)}")
    gemms = args.gemms.split(",")
    bad = [g for g in gemms if g not in GEMMS]
    if bad:
        ap.error(f"argument --gemms: {','.join(bad)}: must be among {', '.join(GEMMS)}")
    if not torch.cuda.is_available():  # after the checks: a typo is said on any machine
        raise SystemExit("needs CUDA: this times GPU kernels (notebook 04 plots committed results on a CPU)")
    bw = copy_bandwidth_gbs()
    rows = []
    for name in shapes:
        for T in args.tokens:
            rows += stages_one(name, T, bw, gemms)
            torch.cuda.empty_cache()  # the shape's weights go before the next is built
    notes = ("bf16, the layer benchmark's seeded weights and policies (native top-k; adaptive: (k/4, k/2, k) at the "
             "entropy terciles; adaptive_q50: (k/2, k) at the median). Each stage of moelab's layer timed alone: "
             "time_us, the eager call (CUDA-event median, do_bench, L2 flushed; a short stage shows its host "
             f"launch time); graph_us, GPU time per call in a CUDA graph of {GRAPH_CALLS} "
             "calls (do_bench median of replays, L2 flushed before each replay). Per expert path (gemm): "
             "'grouped', torch._grouped_mm experts with Triton gather and SwiGLU; 'triton', "
             "moelab.kernels.grouped in the device's tuned configuration, its gate_up with the gather "
             "and SwiGLU fused. layer: the whole layer in one call, pinned to that path. dense_gate_up / "
             "dense_down: the same kept rows through one expert's weights in one GEMM. weights_read_us: all "
             "experts' weights of that GEMM read once at the measured copy bandwidth.")
    print("wrote", write_results("layer-stages", rows, notes=notes, extra={"copy_bandwidth_gbs": bw}))


if __name__ == "__main__":
    main()
