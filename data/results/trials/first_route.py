"""What a new shape's first fp32 routing call costs on a GPU, with the row kernel's chunk loops unrolled up to
T = ROWS_UNROLL_T (main's value, 64 since 103c38f; 512 from 5e46683 to 0459b4e) and with them unrolled only
where BLOCK_E <= 16 (ROWS_UNROLL_T = 0: loops for E > 16, as 58c5b58 had for every E).

For each setting, a fresh process with an empty Triton cache calls `route_triton` on fp32 logits [T, E] at the
embedded models' router shapes (E = 8 / 60 / 64, k = 2 / 4 / 8) and each T in turn, and records the first call's
and the second call's wall time (synchronised) and how many entries the first call added to the cache. A T
whose launch (tile, warps, UNROLL) an earlier T already compiled adds none; a process's first point also
builds Triton's launcher utilities (3 entries, 1-2 s of its first call). The policy is TopK: the fp32 row
kernel takes the policy kind at run time, so one compile serves every kind of a k_max.
--dtype bf16 / fp16 routes 16-bit logits (the 32-bit-key row kernel, which takes the policy kind as a constant);
--other PATH... also runs each other version of moelab/kernels/routing.py (a file, e.g. from `git show`) in a
fresh process of its own, at main's ROWS_UNROLL_T.
Run: PYTHONPATH=lib python data/results/trials/first_route.py [--tokens 1,16,64,512,4096] [--dtype fp32]
     [--other PATH ...] [--out F] (prints JSON)
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = [("tiny-mixtral", 8, 2), ("tiny-qwen-moe", 60, 4), ("tiny-olmoe", 64, 8)]
# --main-job: the (T, E, k_max) that notebooks 01-05 route at the main job's defaults (logged through
# moelab.routing.route in a CPU run of `python -m moelab.sweep --main`; 06's decode steps not included)
MAIN_JOB = ([(512, 64, k) for k in range(2, 9)] + [(1024, 64, 8), (512, 60, 4), (512, 60, 8)]
            + [(512, 8, k) for k in (2, 4, 8)] + [(1024, 8, 1), (1024, 8, 2), (8192, 8, 1), (8192, 8, 2)])


DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def child(threshold: int, tokens: list[int], main_job: bool, dtype: str, module: str) -> None:
    """In this process's own empty cache (TRITON_CACHE_DIR set by the parent): one JSON line per (shape, T)."""
    import importlib.util

    import torch

    import moelab.kernels.routing as kr
    from moelab.routing import TopK

    if module != "main":  # another version of the routing module, under a name of its own
        spec = importlib.util.spec_from_file_location("moelab.kernels._routing_other", module)
        kr = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(kr)

    kr.ROWS_UNROLL_T = threshold
    kr.clear_launch_caches()
    cache = os.environ["TRITON_CACHE_DIR"]
    count = lambda: len(os.listdir(cache)) if os.path.isdir(cache) else 0  # noqa: E731
    dev = os.environ.get("FIRST_ROUTE_DEVICE", "cuda")  # 'cpu' with TRITON_INTERPRET=1: a plumbing check
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    torch.ones(1, device=dev).sum().item()  # CUDA context before the clock
    points = [(f"main-job E={E}", E, k, T) for T, E, k in MAIN_JOB] if main_job else \
        [(name, E, k, T) for name, E, k in SHAPES for T in tokens]
    for name, E, k, T in points:
        logits = torch.randn(T, E, device=dev, generator=torch.Generator(dev).manual_seed(T)).to(
            getattr(torch, DTYPES[dtype]))
        times = []
        before = count()
        for _ in range(2):
            sync()
            t0 = time.perf_counter()
            plan = kr.route_triton(logits, TopK(k), renormalize=False)
            sync()
            times.append(time.perf_counter() - t0)
        prep = list(kr._PREPARED.values())[-1]
        print(json.dumps(dict(module=module, dtype=dtype, rows_unroll_t=threshold, model=name, E=E, k=k, T=T,
                              first_s=round(times[0], 4), second_ms=round(times[1] * 1e3, 4),
                              new_cache_entries=count() - before, kernel=prep.launch.fn.__name__,
                              unroll=bool(prep.meta.get("UNROLL", False)),
                              block_t=prep.meta["BLOCK_T"], warps=prep.warps,
                              kept_pairs=int(plan.k.sum()))), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,16,64,512,4096")
    ap.add_argument("--out", help="also write the JSON here after every setting")
    ap.add_argument("--main-job", action="store_true", help="the main job's routing shapes instead of --tokens")
    ap.add_argument("--thresholds", help="ROWS_UNROLL_T values to compare (default: main's and 0)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="the logits' dtype")
    ap.add_argument("--other", nargs="*", default=[], help="other versions of routing.py, at main's ROWS_UNROLL_T")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--module", default="main", help=argparse.SUPPRESS)
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.child is not None:
        return child(args.child, tokens, args.main_job, args.dtype, args.module)
    import torch
    import triton

    import moelab.kernels.routing as kr

    out = dict(device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
               torch=torch.__version__, triton=triton.__version__,
               python=sys.version.split()[0], command=" ".join(sys.argv), rows=[])
    thresholds = [int(t) for t in args.thresholds.split(",")] if args.thresholds else [kr.ROWS_UNROLL_T, 0]
    settings = [("main", t) for t in thresholds] + [(p, kr.ROWS_UNROLL_T) for p in args.other]
    for module, threshold in settings:
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TRITON_CACHE_DIR=cache)
            t0 = time.perf_counter()
            res = subprocess.run([sys.executable, __file__, "--tokens", args.tokens, "--child", str(threshold),
                                  "--dtype", args.dtype, "--module", module] + ["--main-job"] * args.main_job,
                                 env=env, capture_output=True, text=True)
            if res.returncode:
                sys.exit(f"child {module} ROWS_UNROLL_T={threshold} failed:\n{res.stderr[-4000:]}")
            rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
            out["rows"] += rows
            tag = f"rows_unroll_t_{threshold}" + ("" if module == "main" else f"_{Path(module).stem}")
            out[f"process_s_{tag}"] = round(time.perf_counter() - t0, 1)
            out[f"first_calls_s_{tag}"] = round(sum(r["first_s"] for r in rows), 1)
            for r in rows:
                print(json.dumps(r), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}))


if __name__ == "__main__":
    main()
