"""Trial (data/results/trials/README.md): main's 16-bit row routing kernel launched with programmatic dependent
launch (PDL, sm_90+). At T = 65536 the kernel is one partial wave of a few microseconds, and a memory-only
kernel of the same traffic reaches only 62-73% of the HBM bound: launch, ramp and tail cost a quarter to a
third of it (docs/kernel-notes.md). With PDL a kernel's programs may start while the kernel before it in
the stream drains; they wait (`gdc_wait`, griddepcontrol.wait) before their first load, so they read what
that kernel wrote. Does that hide the ramp? Timed in CUDA graphs as the routing benchmark times (GPU time
per call over a graph of 20 calls), against main's launch, and behind the router GEMM (torch, cuBLAS), where
the routing kernel actually runs in a layer. Not used by main.
Run from the repository root: PYTHONPATH=lib python data/results/trials/routing_pdl.py"""
import inspect
import json
import math
import os
import sys
import textwrap

import torch
import triton

from moelab.kernels import routing as kr
from moelab.routing import EntropyAdaptiveK, TopK

sys.path.insert(0, "benchmarks")
import moe_kernels  # noqa: E402
from moe_kernels import copy_bandwidth_gbs, graph_us, memory_floor  # noqa: E402


def _variant(fn, trigger: str):
    """`fn` (a @triton.jit function) with gdc_wait before its first load and gdc_launch_dependents at the start
    (trigger='start') or before the epilogue (trigger='late'), compiled in its own module's namespace."""
    src = textwrap.dedent(inspect.getsource(fn.fn))
    lines = src.splitlines()
    body = [ln for ln in lines if not ln.startswith("@")]
    out = []
    for ln in body:
        out.append(ln)
        if ln.strip().startswith("pid = tl.program_id(0)") or ln.strip().startswith("rows = tl.program_id(0)"):
            ind = ln[: len(ln) - len(ln.lstrip())]
            if trigger == "start":
                out.append(ind + "tl.extra.cuda.gdc_launch_dependents()")
            out.append(ind + "tl.extra.cuda.gdc_wait()")
    text = "\n".join(out)
    if trigger == "late":  # before the plan is written
        marker = "    lse = tl.log(s)" if "lse = tl.log(s)" in text else "    mx = tl.max(x, axis=1)"
        text = text.replace(marker, "    tl.extra.cuda.gdc_launch_dependents()\n" + marker, 1)
    name = fn.fn.__name__
    ns = dict(vars(sys.modules[fn.fn.__module__]))
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"pdl_{name}_{trigger}.py")
    with open(path, "w") as f:  # Triton reads a jit function's source from its file
        f.write("import triton\nimport triton.language as tl\n" + text + "\n")
    code = compile("import triton\nimport triton.language as tl\n" + text + "\n", path, "exec")
    exec(code, ns)
    dns = [a for a in ("T", "kv_packed", "KMIN") if a in fn.arg_names]
    return triton.jit(do_not_specialize=dns)(ns[name]) if dns else triton.jit(ns[name])


def route_variant(kern, x, policy, pdl: bool):
    """route_triton's plan (bf16 row kernel, no statistics) from `kern`, launched through Triton's public path."""
    T, E = x.shape
    prep = kr._prepare(x, T, E, policy.k_max, policy, False, None)
    assert prep.launch is kr._launch_rows16, "the trial covers the 16-bit row kernel"
    ids, w, k, ent = kr._plan_buffers(T, policy.k_max, x.device)
    args = (x, ids, w, k, ent, k, ent, k, T, E, x.stride(0), *prep.scalars)
    kern[prep.grid](*args, **prep.meta, num_warps=prep.warps, launch_pdl=pdl)
    return ids, w, k, ent


def floor_variant(kern, x, K, pdl: bool):
    T, E = x.shape
    ids, w = torch.empty(T, K, dtype=torch.int32, device=x.device), torch.empty(T, K, device=x.device)
    k, ent = torch.empty(T, dtype=torch.int32, device=x.device), torch.empty(T, device=x.device)
    block_e = triton.next_power_of_2(E)
    block_t = max(16, 1024 // block_e)
    kern[(triton.cdiv(T, block_t),)](x, ids, w, k, ent, T, E=E, K=K, BLOCK_K=triton.next_power_of_2(K),
                                     BLOCK_T=block_t, BLOCK_E=block_e, num_warps=2 if block_e <= 64 else 4,
                                     launch_pdl=pdl)
    return ids, w, k, ent


def main():
    bw = copy_bandwidth_gbs()
    dev = torch.cuda.get_device_name(0)
    print("bw", round(bw), "GB/s", dev, "torch", torch.__version__, "triton", triton.__version__, flush=True)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows16 = {t: _variant(kr._route_rows16_kernel, t) for t in ("start", "late")}
    floors = {t: _variant(moe_kernels._memory_floor_kernel, t) for t in ("start", "late")}
    res = {"device": dev, "torch": torch.__version__, "triton": triton.__version__, "copy_gbs": bw,
           "commit": os.environ.get("MOELAB_COMMIT", ""), "command": "PYTHONPATH=lib python " + " ".join(sys.argv),
           "points": []}
    for E, k, D in ((8, 2, 4096), (60, 4, 2048), (64, 8, 2048), (128, 8, 2048)):
        for T in (4096, 65536):
            g = torch.Generator(device="cuda").manual_seed(E)
            n_in = max(1, min(16, math.ceil(3 * l2 / (T * E * 2))))
            inputs = [torch.randn(T, E, device="cuda", generator=g).to(torch.bfloat16) for _ in range(n_in)]
            inputs[0][::3] = inputs[0][::3].round()  # ties
            calls = max(20, n_in)
            pol = TopK(k)
            ada = EntropyAdaptiveK((max(1, k // 4), max(1, k // 2), k) if k >= 4 else (1, 2),
                                   (1.0, 2.0) if k >= 4 else (1.5,))
            bound = (T * E * 2 + T * k * 8 + T * 8) / (bw * 1e9) * 1e6
            pt = {"E": E, "k": k, "T": T, "hbm_bound_us": bound}
            for pname, p in (("topk", pol), ("adaptive", ada)):
                ref = kr.route_triton(inputs[0], p, False)
                for t, kern in rows16.items():
                    ids, w, kk, ent = route_variant(kern, inputs[0], p, True)
                    same = bool(torch.equal(ids, ref.expert_ids) and torch.equal(w, ref.weights)
                                and torch.equal(kk, ref.k) and torch.equal(ent, ref.entropy))
                    pt[f"{pname}_{t}_same_plan"] = same
                pt[f"{pname}_main"] = graph_us(lambda x, p=p: kr.route_triton(x, p, False), inputs, calls)
                pt[f"{pname}_public"] = graph_us(lambda x, p=p: route_variant(rows16["start"], x, p, False),
                                                 inputs, calls)
                for t, kern in rows16.items():
                    pt[f"{pname}_pdl_{t}"] = graph_us(lambda x, p=p, kern=kern: route_variant(kern, x, p, True),
                                                      inputs, calls)
            pt["floor"] = graph_us(lambda x, k=k: memory_floor(x, k), inputs, calls)
            for t, kern in floors.items():
                pt[f"floor_pdl_{t}"] = graph_us(lambda x, kern=kern, k=k: floor_variant(kern, x, k, True), inputs,
                                                  calls)
            # where routing runs in a layer: behind the router GEMM (cuBLAS, not PDL-aware), graph of pairs
            h = [torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2)]
            wr = torch.randn(D, E, device="cuda", generator=g).to(torch.bfloat16) / D ** 0.5
            pt["gemm_only"] = graph_us(lambda x, wr=wr: x @ wr, h, calls)
            pt["gemm_route_main"] = graph_us(lambda x, wr=wr, pol=pol: kr.route_triton(x @ wr, pol, False), h, calls)
            pt["gemm_route_pdl_start"] = graph_us(
                lambda x, wr=wr, pol=pol: route_variant(rows16["start"], x @ wr, pol, True), h, calls)
            res["points"].append(pt)
            print(f"E={E:3d} k={k} T={T:6d} bound {bound:5.2f} | topk main {pt['topk_main']:6.2f} public "
                  f"{pt['topk_public']:6.2f} pdl start {pt['topk_pdl_start']:6.2f} late {pt['topk_pdl_late']:6.2f} "
                  f"({bound / pt['topk_pdl_start']:.3f} of bound; main {bound / pt['topk_main']:.3f}) | adaptive "
                  f"main {pt['adaptive_main']:6.2f} pdl {pt['adaptive_pdl_start']:6.2f} | floor {pt['floor']:5.2f} "
                  f"pdl {pt['floor_pdl_start']:5.2f}/{pt['floor_pdl_late']:5.2f} | gemm {pt['gemm_only']:6.2f} "
                  f"+route main {pt['gemm_route_main']:6.2f} pdl {pt['gemm_route_pdl_start']:6.2f} | same "
                  f"{[v for kk_, v in pt.items() if kk_.endswith('same_plan')]}", flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "routing-pdl.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
