"""fp32 routing speed: main's routing module against other versions of routing.py (e.g. before ceda31b).

At ceda31b / 63f5f7f the fp32 row kernel began to take the policy kind, its scalars and k values at run time
(one compile per k_max) and to loop over its chunks instead of unrolling them. No committed figure uses fp32
routing, but the embedded models do (notebooks, paper tables). This times `route_triton` on fp32 logits
[T, E] for the embedded models' router shapes (E = 8 / 60 / 64, k = 2 / 4 / 8) and up to four policies,
through main's module and through each OTHER file (named by its stem), in a CUDA graph
(`moe_kernels.graph_us`, inputs rotated past the L2) and eager (`moe_kernels.interleaved_eager_us`: host
loop, Python launch included, the modules in turn), checks that each gives main's expert ids and k
(and records the largest weight difference), and names the kernel that served each call.
--dtype bf16 / fp16 times 16-bit logits instead (the 32-bit-key row kernel; the same shapes).
Run: PYTHONPATH=lib python data/results/trials/fp32_rows.py OTHER [OTHER ...] [--policies ...] [--dtype fp32]
     [--out F] (prints JSON).
"""

import argparse
import functools
import importlib.util
import json
import math
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, "benchmarks")

TOKENS = [1, 16, 64, 512, 4096, 65536]
SHAPES = [("tiny-mixtral", 8, 2, True), ("tiny-qwen-moe", 60, 4, False), ("tiny-olmoe", 64, 8, False)]


def load(path: str):
    spec = importlib.util.spec_from_file_location(f"moelab.kernels._routing_{Path(path).stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def served_by(mod) -> str:
    """The kernel of the launch prepared last (one key per module per point: the caches are cleared)."""
    (prep,) = list(mod._PREPARED.values())[-1:]
    return prep.launch.fn.__name__


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("other", nargs="+", help="paths of other versions of moelab/kernels/routing.py")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--policies", default="TopK,EntropyAdaptiveK,TopP,RatioSkip")
    ap.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="the logits' dtype")
    ap.add_argument("--out", help="also write the JSON here after every point (a stopped run keeps its rows)")
    args = ap.parse_args()
    from moe_kernels import adaptive_policy, copy_bandwidth_gbs, graph_us, interleaved_eager_us

    import moelab.kernels.routing as new
    from moelab.routing import RatioSkip, TopK, TopP, route_torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    size = dtype.itemsize
    mods = {"main": new} | {Path(p).stem: load(p) for p in args.other}
    bw = copy_bandwidth_gbs()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []

    def dump(rows) -> str:
        text = json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                           "triton": triton.__version__, "dtype": args.dtype, "other": args.other,
                           "copy_bandwidth_gbs": bw, "rows": rows},
                          indent=1)
        if args.out:
            Path(args.out).write_text(text)
        return text

    for name, E, k, renorm in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(E)
        ada = adaptive_policy(route_torch(torch.randn(4096, E, device="cuda", generator=g), TopK(k), renorm).entropy, k)
        policies = {"TopK": TopK(k), "EntropyAdaptiveK": ada, "TopP": TopP(0.6, k), "RatioSkip": RatioSkip(0.3, k)}
        policies = {n: policies[n] for n in args.policies.split(",")}
        for T in map(int, args.tokens.split(",")):
            n_in = max(1, min(16, math.ceil(3 * l2 / (T * E * size))))
            inputs = [torch.randn(T, E, device="cuda", generator=g).to(dtype) for _ in range(n_in)]
            calls = max(20, n_in)
            for pname, pol in policies.items():
                fns, kernel, plans = {}, {}, {}
                for m, mod in mods.items():
                    mod._PREPARED.clear()
                    plans[m] = mod.route_triton(inputs[0], pol, renorm)
                    fns[m] = functools.partial(mod.route_triton, policy=pol, renormalize=renorm)
                    kernel[m] = served_by(mod)
                a = plans["main"]
                same = {m: bool(torch.equal(a.expert_ids, b.expert_ids) and torch.equal(a.k, b.k))
                        for m, b in plans.items()}  # ids and k; weights: their largest difference
                wdiff = {m: float((a.weights - b.weights).abs().max()) if T else 0.0 for m, b in plans.items()}
                eager = interleaved_eager_us({m: functools.partial(f, inputs[0]) for m, f in fns.items()})
                graph = {m: graph_us(f, inputs, calls) for m, f in fns.items()}
                rows.append({"model": name, "E": E, "native_k": k, "T": T, "policy": repr(pol), "kernel": kernel,
                             "same_ids_as_main": same, "max_weight_diff_to_main": wdiff, "graph_us": graph,
                             "eager_us": eager,
                             "hbm_bound_us": (T * E * size + T * k * 8 + T * 8) / (bw * 1e9) * 1e6})
                print(f"{name:14s} T={T:6d} {pname:17s} graph " + " ".join(f"{m} {v:6.2f}" for m, v in graph.items())
                      + " us  eager " + " ".join(f"{m} {v:5.1f}" for m, v in eager.items())
                      + f" us  {kernel['main']} same={all(same.values())}", file=sys.stderr, flush=True)
                dump(rows)
    print(dump(rows))


if __name__ == "__main__":
    main()
