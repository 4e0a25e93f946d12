"""Trials (data/results/trials/README.md): routing launches main does not have, against the tuned launch at
T = 65536 / 4096, E = 64 and 128, bf16, in CUDA graphs; the plans checked against main's launch.
  tree: 'rowtree' (ran at a678a3a), loop: the row kernel's blocks looped over by fewer programs (ran at 5dec6cb).
Run from the repository root: PYTHONPATH=lib python data/results/trials/routing_launch.py tree|loop"""
import math, sys, json, os
import torch
sys.path.insert(0, "benchmarks")
from moe_kernels import graph_us, adaptive_policy, copy_bandwidth_gbs, memory_floor
from moelab.kernels import routing as kr
from moelab.kernels.routing import route_triton, RoutingStats
from moelab.routing import TopK, route_torch

TRIAL = sys.argv[1]  # "tree" | "loop"
RESET = dict(select=None, tile=None, warps=None, split=None, **(dict(programs=None, stages=None) if TRIAL == "loop" else {}))
bw = copy_bandwidth_gbs()
l2 = torch.cuda.get_device_properties(0).L2_cache_size
print("bw", bw, flush=True)
res = []
for E, k in ((64, 8), (128, 8)):
    g = torch.Generator(device="cuda").manual_seed(E)
    calib = torch.randn(4096, E, device="cuda", generator=g)
    ada = adaptive_policy(route_torch(calib, TopK(k), False).entropy, k)
    for T in (65536, 4096):
        per = T * E * 2
        n_in = max(1, min(16, math.ceil(3 * l2 / per)))
        inputs = [torch.randn(T, E, device="cuda", generator=g).to(torch.bfloat16) for _ in range(n_in)]
        calls = max(20, n_in)
        stats = RoutingStats.zeros(k, "cuda")
        bound = (T * E * 2 + T * k * 8 + T * 8) / (bw * 1e9) * 1e6
        configs = [("tuned", None)]
        if TRIAL == "loop":
            for stages in (1, 2, 3):
                for progs in (2, 4, 8, 16):
                    configs.append((f"loop p{progs} st{stages}", dict(programs=progs, stages=stages)))
        else:
            for split in (1, 2, 4):
                for warps in (1, 2, 4):
                    rows = 32 * warps // split
                    configs.append((f"rowtree w{warps} s{split} r{rows}",
                                    dict(select="rowtree", warps=warps, split=split, tile=rows * (1 << (E - 1).bit_length()))))
            configs.append(("rowsort w2 s2 r32", dict(select="rowsort", warps=2, split=2, tile=32 * (1 << (E - 1).bit_length()))))
        ref = {m: route_triton(inputs[0], p, False) for m, p in (("topk", TopK(k)), ("ada", ada))}
        mf = graph_us(lambda x: memory_floor(x, k), inputs, calls)
        print(f"E={E} T={T} bound {bound:.2f} memory_floor {mf:.2f}", flush=True)
        for name, cfg in configs:
            kr.LAUNCH.update(RESET)
            if cfg:
                kr.LAUNCH.update(cfg)
            kr.clear_launch_caches()
            out = {}
            for m, fn in (("topk", lambda x: route_triton(x, TopK(k), False)), ("ada", lambda x: route_triton(x, ada, False)),
                          ("ada_stats", lambda x: route_triton(x, ada, False, stats))):
                if m != "ada_stats":
                    got = fn(inputs[0])
                    r = ref[m]
                    same = torch.equal(got.expert_ids, r.expert_ids) and torch.equal(got.k, r.k) and float((got.weights - r.weights).abs().max()) <= 1e-6
                    if not same:
                        print("  MISMATCH", name, m, flush=True)
                out[m] = graph_us(fn, inputs, calls)
            row = dict(E=E, T=T, config=name, bound=bound, memory_floor=mf, **out)
            res.append(row)
            print(f"  {name:24s} " + " ".join(f"{m} {us:6.2f} ({bound / us:.2f})" for m, us in out.items()), flush=True)
kr.LAUNCH.update(RESET)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), f"routing_{TRIAL}.json"), "w"), indent=1)
