"""fp32 routing speed: main's module against another version's routing.py (before ceda31b: policy kind compiled in).

At ceda31b / 63f5f7f the fp32 row kernel began to take the policy kind, its scalars and k values at run time
(one compile per k_max) and to loop over its chunks instead of unrolling them. No committed figure uses fp32
routing, but the embedded models do (notebooks, paper tables). This times `route_triton` on fp32 logits
[T, E] for the embedded models' router shapes (E = 8 / 60 / 64, k = 2 / 4 / 8) and four policies, through
main's module and through OLD, in a CUDA graph (`moe_kernels.graph_us`, inputs rotated past the L2) and
eager (`moe_kernels.interleaved_eager_us`: host loop, Python launch included, both modules in turn), checks
that both give the same plan, and names the kernel that served each call.
Run: PYTHONPATH=lib python data/results/trials/fp32_rows.py OLD (prints JSON).
"""

import argparse
import functools
import importlib.util
import json
import math
import sys

import torch
import triton

sys.path.insert(0, "benchmarks")

TOKENS = [1, 16, 64, 512, 4096, 65536]
SHAPES = [("tiny-mixtral", 8, 2, True), ("tiny-qwen-moe", 60, 4, False), ("tiny-olmoe", 64, 8, False)]


def load(path: str):
    spec = importlib.util.spec_from_file_location("moelab.kernels._routing_old", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def served_by(mod) -> str:
    """The kernel of the launch prepared last (one key per module per point: the caches are cleared)."""
    (prep,) = list(mod._PREPARED.values())[-1:]
    return prep.launch.fn.__name__


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", help="path of the other version's moelab/kernels/routing.py")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    args = ap.parse_args()
    from moe_kernels import adaptive_policy, copy_bandwidth_gbs, graph_us, interleaved_eager_us

    import moelab.kernels.routing as new
    from moelab.routing import RatioSkip, TopK, TopP, route_torch

    old = load(args.old)
    mods = {"main": new, "old": old}
    bw = copy_bandwidth_gbs()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for name, E, k, renorm in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(E)
        ada = adaptive_policy(route_torch(torch.randn(4096, E, device="cuda", generator=g), TopK(k), renorm).entropy, k)
        policies = {"TopK": TopK(k), "EntropyAdaptiveK": ada, "TopP": TopP(0.6, k), "RatioSkip": RatioSkip(0.3, k)}
        for T in map(int, args.tokens.split(",")):
            n_in = max(1, min(16, math.ceil(3 * l2 / (T * E * 4))))
            inputs = [torch.randn(T, E, device="cuda", generator=g) for _ in range(n_in)]
            calls = max(20, n_in)
            for pname, pol in policies.items():
                fns = {}
                for m, mod in mods.items():
                    mod._PREPARED.clear()
                    a = mod.route_triton(inputs[0], pol, renorm)
                    fns[m] = functools.partial(mod.route_triton, policy=pol, renormalize=renorm)
                    fns[m + "_kernel"] = served_by(mod)
                    fns[m + "_plan"] = a
                pa, pb = fns["main_plan"], fns["old_plan"]
                same = (torch.equal(pa.expert_ids, pb.expert_ids) and torch.equal(pa.k, pb.k)
                        and torch.equal(pa.weights, pb.weights))
                eager = interleaved_eager_us({m: functools.partial(fns[m], inputs[0]) for m in mods})
                row = {"model": name, "E": E, "native_k": k, "T": T, "policy": repr(pol), "same_plan": same}
                for m in mods:
                    row[m + "_kernel"] = fns[m + "_kernel"]
                    row[m + "_graph_us"] = graph_us(fns[m], inputs, calls)
                    row[m + "_eager_us"] = eager[m]
                row["hbm_bound_us"] = (T * E * 4 + T * k * 8 + T * 8) / (bw * 1e9) * 1e6
                rows.append(row)
                print(f"{name:14s} T={T:6d} {pname:17s} graph main {row['main_graph_us']:7.2f} old "
                      f"{row['old_graph_us']:7.2f} us  eager main {row['main_eager_us']:6.1f} old "
                      f"{row['old_eager_us']:6.1f} us  {row['main_kernel']}/{row['old_kernel']} same={same}",
                      file=sys.stderr, flush=True)
    print(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                      "triton": triton.__version__, "old": args.old, "copy_bandwidth_gbs": bw, "rows": rows},
                     indent=1))


if __name__ == "__main__":
    main()
