"""Do two versions of moelab/kernels/routing.py compile the benchmarked routing calls to the same PTX?

Compiles, on this GPU, every routing kernel that `benchmarks/moe_kernels.py --parts routing` launches (bf16
logits, its four shapes and six token counts; native TopK, its adaptive policy, the adaptive policy with
statistics) through the current module and through OLD (another version's routing.py), one process per
(version, shape) in parallel, then compares each compiled kernel's PTX with the debug lines (.loc, .file,
the debug sections) taken out. Same PTX: the benchmark's numbers hold for both versions.
Run: PYTHONPATH=lib python data/results/trials/ptx_same.py OLD (prints JSON).
"""

import argparse
import hashlib
import importlib.util
import json
import re
import subprocess
import sys

import torch

sys.path.insert(0, "benchmarks")


def load(path: str):
    if path == "new":
        import moelab.kernels.routing as mod

        return mod
    spec = importlib.util.spec_from_file_location("moelab.kernels._routing_old", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def strip(ptx: str) -> str:
    ptx = re.sub(r"\.section\s+\.debug\w*\s*\{.*?\n\s*\}", "", ptx, flags=re.S)
    return "\n".join(ln for ln in ptx.splitlines() if not re.match(r"\s*(\.loc|\.file|//|$)", ln))


def worker(path: str, shape: str) -> dict:
    """{kernel name and cache key (device left out): (sha256 of the stripped PTX, its lines)} for one shape."""
    from moe_kernels import ROUTING_SHAPES, TOKENS, adaptive_policy

    from moelab.routing import TopK, route_torch

    mod = load(path)
    ((name, E, k, renorm),) = [s for s in ROUTING_SHAPES if s[0] == shape]
    g = torch.Generator(device="cuda").manual_seed(E)
    ada = adaptive_policy(route_torch(torch.randn(4096, E, device="cuda", generator=g), TopK(k), renorm).entropy, k)
    for T in TOKENS:
        x = torch.randn(T, E, device="cuda", generator=g).to(torch.bfloat16)
        for _ in range(2):  # compile, then the cached entry
            a = mod.route_triton(x, TopK(k), renorm)
            b = mod.route_triton(x, ada, renorm)
            mod.route_triton(x, ada, renorm, mod.RoutingStats.zeros(ada.k_max, "cuda"))
        assert torch.equal(b.expert_ids, route_torch(x, ada, renorm).expert_ids) and int(a.k.min()) == k
    out = {}
    for lau in (mod._launch, mod._launch_rows, mod._launch_rows16):
        for key, (kernel, _, _) in lau.cache.items():
            s = strip(kernel.asm["ptx"])
            out[f"{lau.fn.__name__} {key[1:]!r}"] = (hashlib.sha256(s.encode()).hexdigest(), len(s.splitlines()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", help="path of the other version's moelab/kernels/routing.py")
    ap.add_argument("--worker", nargs=2, metavar=("MODULE", "SHAPE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return
    from moe_kernels import ROUTING_SHAPES

    procs = {(mod, s[0]): subprocess.Popen([sys.executable, __file__, args.old, "--worker", mod, s[0]],
                                           stdout=subprocess.PIPE, text=True)
             for mod in ("new", args.old) for s in ROUTING_SHAPES}
    got = {"new": {}, "old": {}}
    for (mod, _), p in procs.items():
        out, _ = p.communicate()
        if p.returncode:
            raise SystemExit(f"worker {mod} failed ({p.returncode})")
        got["new" if mod == "new" else "old"].update(json.loads(out))
    rows = [{"kernel": key, "in_old": key in got["old"], "same_ptx": got["old"].get(key, [None])[0] == h,
             "ptx_lines": n} for key, (h, n) in sorted(got["new"].items())]
    print(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                      "triton": __import__("triton").__version__, "old": args.old, "kernels_new": len(got["new"]),
                      "kernels_old": len(got["old"]), "same_ptx": sum(r["same_ptx"] for r in rows), "rows": rows},
                     indent=1))


if __name__ == "__main__":
    main()
