"""Ablation of the Triton routing kernel at large T: where its time above a memory-only kernel goes.

The row kernel of `moelab.kernels.routing` (bf16 logits, the launch the per-device table picks) is
compiled again from its source with parts taken out, and timed in a CUDA graph beside the full kernel
and `memory_floor` (moe_kernels.py: read the logits, write a plan of the same size, no work):
  full           the kernel as shipped
  no_selection   each 8-key chunk folded into a running max instead of sorted and merged into the best
                 eight (at launches where the table picks 'rowsort'; rows record it); the split merge and the
                 epilogue stay
  no_exp         exp2 replaced by the identity in the online softmax / entropy sums
  neither        both
The ablated kernels compute wrong plans: this measures time only. Beside the times, `profile` (in the
results file's extra) describes the shipped kernel as compiled for each E: registers, programs, how many
fit on an SM at once (`occupancy`) and the instruction mix of its chunk loop, one 8-logit chunk per
thread and iteration (`sass_loop_mix`, from the SASS Triton keeps): what the time is spent issuing.
Topic `routing-ablation`.

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
from moe_kernels import copy_bandwidth_gbs, graph_us, ints_at_least, memory_floor  # noqa: E402

KERNEL = Path(__file__).resolve().parents[1] / "lib" / "moelab" / "kernels" / "routing.py"
SELECTION = [  # the k <= 8 chunk step; a K > 8 kernel would merge the unsorted keys (not ablated: k = 8 here)
    ("        k0, k1, k2, k3, k4, k5, k6, k7 = _sort8(k0, k1, k2, k3, k4, k5, k6, k7)\n", ""),
    ("            v0, v1, v2, v3, v4, v5, v6, v7 = _top8("
     "v0, v1, v2, v3, v4, v5, v6, v7, k0, k1, k2, k3, k4, k5, k6, k7)",
     "            v0 = tl.maximum(v0, tl.maximum(tl.maximum(tl.maximum(k0, k1), tl.maximum(k2, k3)),\n"
     "                                           tl.maximum(tl.maximum(k4, k5), tl.maximum(k6, k7))))"),
]
EXP = [("e = tl.exp2(d * LOG2E)", "e = d"), ("a = tl.exp2(sh * LOG2E)", "a = sh")]
VARIANTS = {"full": [], "no_selection": SELECTION, "no_exp": EXP, "neither": [*SELECTION, *EXP]}
MINMAX = ("VIMNMX", "VIMNMX3", "IMNMX", "FMNMX")  # integer / float min and max (the selection's compare-exchanges)
# per-SM limits of compute capability 9.0 (CUDA C programming guide, Technical Specifications)
SM90 = {"regs": 65536, "threads": 2048, "blocks": 32, "smem": 233472, "reg_unit": 256, "smem_per_block": 1024}


def occupancy(regs: int, warps: int, smem: int, limits: dict = SM90) -> int:
    """Programs of `warps` warps, `regs` registers per thread and `smem` bytes of shared memory that fit on one SM
    at once: registers are given out per warp in units of limits['reg_unit'], the driver keeps 1 KB per block."""
    per_warp = -(-regs * 32 // limits["reg_unit"]) * limits["reg_unit"]
    by_regs = (limits["regs"] // per_warp) // warps if per_warp else limits["blocks"]
    by_smem = limits["smem"] // (smem + limits["smem_per_block"])
    return max(0, min(limits["blocks"], limits["threads"] // (32 * warps), by_regs, by_smem))


def sass_loop_mix(sass: str) -> dict:
    """Opcode counts (the mnemonic before its first '.', predicates dropped) of the first loop in a SASS listing: the
    lines after a label `NAME:` up to the later `BRA NAME` that jumps back to it."""
    lines = [ln.split("\t", 1)[-1].strip() for ln in sass.splitlines()]
    labels = {ln[:-1]: i for i, ln in enumerate(lines) if ln.endswith(":") and " " not in ln}
    for j, ln in enumerate(lines):
        op = ln.split()
        if op and op[0].startswith("@"):
            op = op[1:]
        if len(op) >= 2 and op[0].startswith("BRA") and op[-1].rstrip(";") in labels:
            i = labels[op[-1].rstrip(";")]
            if i < j:
                mix: dict = {}
                for body in lines[i + 1:j + 1]:
                    toks = body.split()
                    if toks and toks[0].startswith("@"):
                        toks = toks[1:]
                    if toks and not body.endswith(":"):
                        name = toks[0].split(".")[0]
                        mix[name] = mix.get(name, 0) + 1
                return mix
    raise ValueError("no backward branch in this SASS listing: no loop to count")


def shipped_launch(mod, x: torch.Tensor, K: int) -> tuple:
    """(launcher, grid, scalar arguments, constexprs, warps) that `mod.route_triton` prepares for logits x, TopK(K)."""
    prep = mod._prepare(x, x.shape[0], x.shape[1], K, TopK(K), False, None)
    return prep.launch, prep.grid, prep.scalars, prep.meta, prep.warps


def profile(mod, T: int, E: int, K: int) -> dict:
    """The shipped launch for bf16 [T, E] logits, top-K: registers, programs, programs per SM, waves and the chunk
    loop's instruction mix (8 logits per thread and iteration)."""
    x = torch.randn(T, E, device="cuda").bfloat16()
    launch, grid, scalars, meta, warps = shipped_launch(mod, x, K)
    ids, w, k, ent = mod._plan_buffers(T, K, x.device)
    ck = launch.fn[grid](x, ids, w, k, ent, k, ent, k, T, E, x.stride(0), *scalars, **meta, num_warps=warps)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    fit = occupancy(ck.n_regs, warps, ck.metadata.shared)
    mix = sass_loop_mix(ck.asm["sass"])
    per_chunk = sum(mix.values())
    ch = meta.get("CH", 8)
    return {"E": E, "k": K, "T": T, "launch": {n: meta[n] for n in ("BLOCK_T", "SPLIT", "CH", "SORT") if n in meta},
            "warps": warps, "regs": ck.n_regs, "spills": ck.n_spills, "shared": ck.metadata.shared,
            "programs": grid[0], "programs_per_sm": fit, "waves": grid[0] / (fit * sms) if fit else None,
            "loop_mix": mix, "loop_instructions": per_chunk, "logits_per_iteration": ch,
            "instructions_per_logit": per_chunk / ch,
            "minmax_per_logit": sum(mix.get(m, 0) for m in MINMAX) / ch, "mufu_per_logit": mix.get("MUFU", 0) / ch}


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
    ap.add_argument("--experts", type=ints_at_least(8), default="64,128", help="comma list of E (k = 8)")
    args = ap.parse_args()
    if args.tokens < 1:
        ap.error(f"argument --tokens: {args.tokens}: must be an int >= 1")
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA: this times GPU kernels")
    bw = copy_bandwidth_gbs()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows, prof = [], []
    with tempfile.TemporaryDirectory() as tmp:
        mods = {name: ablated(name, patches, Path(tmp)) for name, patches in VARIANTS.items()}
        T, K = args.tokens, 8
        for E in args.experts:
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
            try:
                prof.append(profile(mods["full"], T, E, K))
                print("profile", prof[-1], flush=True)
            except (KeyError, ValueError, AttributeError) as e:  # no SASS from this Triton: times only
                print(f"E={E}: no kernel profile ({type(e).__name__}: {e})", flush=True)
    notes = ("bf16 logits, native top-8, GPU time per call in a CUDA graph of 20 calls, inputs rotated past 3x L2 "
             "(as benchmarks/moe_kernels.py). Variants of the Triton row kernel compiled from its source with parts "
             "taken out (times only: their plans are wrong); memory_floor: moe_kernels.memory_floor. hbm_bound_us: "
             "logits read + plan written at the measured copy bandwidth. profile: the shipped "
             "kernel as compiled for each E: registers, programs, programs that fit on one SM (registers, threads, "
             "shared memory), waves, and the static instruction mix of its chunk loop (8 logits per thread and "
             "iteration): instructions, min/max and MUFU per logit.")
    print("wrote", write_results("routing-ablation", rows, notes=notes,
                                 extra={"copy_bandwidth_gbs": bw, "profile": prof}))


if __name__ == "__main__":
    main()
