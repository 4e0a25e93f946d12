"""Why a policy's first patched forward is slow: Triton compiles the kernels of each new k_max (and kind).

The routing kernel takes k_max (and, except in the fp32 row kernel, the policy kind) as compile-time
constants, so the first call of each new (k_max, dtype, tile[, kind]) compiles a kernel, and a new k_max
also the layout and expert kernels; Triton keeps them in its disk cache (TRITON_CACHE_DIR).
For each model and the policy kinds paper_tables evaluates, in its order, this times the first and the
second patched forward of one batch of windows in a fresh process with an empty Triton cache ('cold'),
then in a second fresh process that finds the kernels the first compiled ('warm disk cache'), and counts
the kernels each first forward compiled. Writes data/results/first-call.json.

GPU:  PYTHONPATH=lib python benchmarks/first_call.py --models tiny-olmoe,tiny-qwen-moe
CPU:  the torch routing path compiles nothing; the script runs (plumbing) but measures no compile.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from moelab.results import write_results


def policies(native_k: int, family: str, num_experts: int):
    """(job, policy) in paper_tables' order of first use: native k, the published configurations, the
    calibrated kinds, lower fixed k."""
    from moelab.paper import calibration_k_values, lower_fixed_ks, published_configs
    from moelab.routing import EntropyAdaptiveK, RatioSkip, TopK, TopP

    kv = calibration_k_values(family, native_k)
    th = tuple(0.5 + 0.5 * i for i in range(len(kv) - 1))  # any ascending thresholds: the kernel is the same
    jobs = [(f"TopK k={native_k}", TopK(native_k))]
    jobs += [(name, pol) for name, pol in published_configs(family, num_experts).items()]
    jobs += [("EntropyAdaptiveK", EntropyAdaptiveK(kv, th)),
            ("TopP", TopP(0.9, k_max=kv[-1], k_min=kv[0])), ("RatioSkip", RatioSkip(0.3, k_max=kv[-1], k_min=kv[0]))]
    jobs += [(f"TopK k={k}", TopK(k)) for k in lower_fixed_ks(native_k)]
    return jobs


def entries(cache: str) -> int:
    return len(os.listdir(cache)) if os.path.isdir(cache) else 0


def child(args) -> list[dict]:
    """One process: every job's first and second forward, with the kernels each first forward compiled."""
    from moelab.data import eval_text
    from moelab.evaluate import evaluate
    from moelab.models import load, moe_info

    cache = os.environ["TRITON_CACHE_DIR"]
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = []
    for name in args.models.split(","):
        model, tok = load(name, device=dev, dtype=torch.float32)
        info = moe_info(model)
        ctx = min(args.context, model.config.max_position_embeddings)
        n = args.windows * ctx
        ids = torch.tensor(tok(eval_text(), add_special_tokens=False)["input_ids"][:n], dtype=torch.long)
        kw = dict(context=ctx, stride=ctx, batch_size=args.windows, progress=False)
        t0 = time.perf_counter()
        evaluate(model, None, ids, **kw)  # the unchanged model first: CUDA, cuBLAS and allocator warm-up
        sync()
        warm_s = time.perf_counter() - t0
        for job, pol in policies(info["native_k"], info["family"], info["num_experts"]):
            times, compiled = [], []
            for _ in range(2):
                before = entries(cache)
                t0 = time.perf_counter()
                evaluate(model, pol, ids, **kw)
                sync()
                times.append(time.perf_counter() - t0)
                compiled.append(entries(cache) - before)
            rows.append({"model": name, "job": job, "phase": args.phase, "first_s": times[0], "second_s": times[1],
                         "compiled_first": compiled[0], "compiled_second": compiled[1], "tokens": n,
                         "windows": args.windows, "context": ctx, "baseline_first_s": warm_s})
            print(f"{args.phase:5s} {name:14s} {job:18s} first {times[0]:7.2f}s second {times[1]:6.2f}s "
                  f"compiled {compiled[0]} / {compiled[1]}", flush=True)
        del model
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny-olmoe")
    ap.add_argument("--windows", type=int, default=64, help="windows per forward (paper_tables' GPU batch: 64)")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--phase", default=None, help=argparse.SUPPRESS)  # set for the child processes
    ap.add_argument("--rows-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.windows < 1 or args.context < 2:
        raise SystemExit(f"--windows {args.windows} / --context {args.context}: need >= 1 / >= 2")
    if not args.phase:  # in the parent, before any child: a bad name or device is one clear error, not two tracebacks
        from moelab.models import pick_device, resolve

        try:
            args.device = str(pick_device(args.device))  # 'auto' named for the children
        except ValueError as e:
            ap.error(f"argument --device: {e}")
        if not args.models.strip(", "):
            ap.error("argument --models: no model named")
        for name in (m.strip() for m in args.models.split(",") if m.strip()):
            try:
                resolve(name)
            except (ValueError, FileNotFoundError) as e:
                ap.error(f"argument --models: {e}")
    if args.phase:
        rows = child(args)
        with open(args.rows_out, "w") as f:
            json.dump(rows, f)
        return
    notes = ("First and second patched forward (fp32, one batch of windows of WikiText-2 test) per policy, in a fresh "
             "process with an empty Triton cache of the model's own (phase cold) and in a second fresh process with "
             "the cache the first "
             "filled (phase warm). compiled_first / compiled_second: new entries in TRITON_CACHE_DIR during the "
             "first / second forward. "
             "baseline_first_s: the unchanged model's first forward in that process (warm-up, not a policy).")
    rows, path = [], None
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    with tempfile.TemporaryDirectory(prefix="moelab-first-call-") as tmp:
        for i, name in enumerate(names):
            cache = os.path.join(tmp, f"triton-cache-{i}")  # each model starts from an empty cache of its own
            env = dict(os.environ, TRITON_CACHE_DIR=cache)
            for phase in ("cold", "warm"):  # the second process finds what the first compiled on disk
                out = os.path.join(tmp, f"rows-{i}-{phase}.json")
                cmd = [sys.executable, os.path.abspath(__file__), "--models", name, "--windows", str(args.windows),
                       "--context", str(args.context), "--device", args.device, "--phase", phase, "--rows-out", out]
                subprocess.run(cmd, env=env, check=True)
                with open(out) as f:
                    rows += json.load(f)
                # written after each process, so a run cut short keeps what finished
                done = i == len(names) - 1 and phase == "warm"
                path = write_results("first-call", rows, notes=notes, extra={"complete": done})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
