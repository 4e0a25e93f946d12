"""Training seeds: do the adaptive-k findings hold for other training seeds of the same models?

Each embedded geometry is trained again with --seeds more seeds (the shipped recipe, `tools/train.py`: seeds other
than the shipped checkpoint's), as parallel processes on one GPU, into --out (outside data/; weights are not kept).
Then on every seed and on the shipped checkpoint: the matched-compute comparison at the paper levels (every rule of
`moelab.paper.paper_rows`, paired bootstrap intervals) and the +0.5% budget calibration. Writes the results topic
seeds: one row per (model, seed, rule, level) (section matched), per (model, seed) budget result (section
calibrated) and per (model, seed, level, pair of rules) comparison (section comparison).

GPU, one device call of at most ~9 minutes (training 9 runs takes most of it; --time-limit stops in time and
--resume in a second call finishes the (model, seed) pairs left, reusing checkpoints already trained in --out
and, where the results folder is fresh, the copy of the results file kept there):
    PYTHONPATH=lib python benchmarks/seeds.py --time-limit 500
    PYTHONPATH=lib python benchmarks/seeds.py --time-limit 500 --resume
CPU micro run (a few steps, a few hundred tokens; tests/test_paper.py runs it):
    python benchmarks/seeds.py --models tiny-mixtral --seeds 1 --eval-tokens 256 --cal-tokens 256 \\
        --budget-steps 1 --targets 0.25 --resamples 50 --train '{"max_steps": 2, "batch_size": 2, ...}'
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "lib"), str(REPO / "tools"), str(REPO / "benchmarks")]

from paper_tables import int_at_least, positive_real, reductions  # noqa: E402

from moelab import models  # noqa: E402
from moelab.results import commit, machine, read_file, read_json, results_dir, write_json, write_results  # noqa: E402

log = logging.getLogger("seeds")
DROP = ("window_nll", "window_tokens", "claimed_model", "pr_reduction", "paper_native_k", "paper_mean_k",
        "paper_compute", "paper_ppl_base", "paper_ppl_adaptive")  # per-window data and the claims: in paper-tables


def shipped_seed(model: str) -> int:
    return json.loads((models.model_dir(model) / "train_log.json").read_text())["config"]["seed"]


def seeds_for(model: str, n: int) -> list[int]:
    """The first n seeds >= 0 other than the shipped checkpoint's."""
    ship = shipped_seed(model)
    return [s for s in range(n + 1) if s != ship][:n]


def one(model: str, seed: int, args) -> dict:
    """Train (unless shipped, or already trained in --out) and evaluate one (model, seed): its rows."""
    from train import recipe, train

    from moelab.calibrate import calibration_ids
    from moelab.data import eval_text
    from moelab.models import load, reference_experts
    from moelab.paper import paper_rows

    shipped = seed == shipped_seed(model)
    path = models.model_dir(model) if shipped else Path(args.out) / f"{model}-s{seed}"
    t0 = time.perf_counter()
    done, cfg = path / "train_log.json", dataclasses.asdict(recipe(model, seed=seed, out=str(path), **args.train))
    if not shipped and not (done.exists() and json.loads(done.read_text())["config"] == cfg):  # else trained before
        train(recipe(model, seed=seed, out=str(path), **args.train))
    tlog = json.loads(done.read_text())
    train_s = time.perf_counter() - t0
    net, tok = load(path, device=args.device, dtype=torch.float32)
    reference_experts(net)
    eval_ids = torch.tensor(tok(eval_text(), add_special_tokens=False)["input_ids"][: args.eval_tokens])
    out = paper_rows(net, model, eval_ids, calibration_ids(tok, args.cal_tokens), context=args.context,
                     stride=args.context, batch_size=args.batch_size, budget=args.budget,
                     budget_steps=args.budget_steps, targets=args.targets, margins=(), progress=False,
                     resamples=args.resamples, bootstrap_seed=args.bootstrap_seed, train_seed=seed)
    keep = {"seed": seed, "shipped": shipped, "best_val_loss": tlog["best_val_loss"], "train_steps": tlog["steps"],
            "eval_tokens": int(eval_ids.numel()), "cal_tokens": args.cal_tokens, "device": machine()["device"],
            "commit": commit()}  # per row: a resumed run may finish on another machine
    rows = [{**{k: v for k, v in r.items() if k not in DROP}, **keep} for r in out["rows"]
            if r["section"] in ("baseline", "calibrated", "matched")]
    rows += [{"model": model, "section": "comparison", **c, **keep} for c in out["comparisons"].to_dict("records")
             if c.get("text") == "wikitext2"]
    return {"model": model, "seed": seed, "rows": rows, "train_s": train_s,
            "eval_s": time.perf_counter() - t0 - train_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(models.NAMES), help="comma list of embedded models")
    ap.add_argument("--seeds", type=int_at_least(1), default=3, help="new training seeds per model")
    ap.add_argument("--workers", type=int_at_least(1), default=3, help="(model, seed) processes at once on the GPU")
    ap.add_argument("--out", type=Path, default=Path("/tmp/moelab-seeds"), help="checkpoints (not kept) and parts")
    ap.add_argument("--eval-tokens", type=int_at_least(2), default=65536, help="first N WikiText-2 test tokens")
    ap.add_argument("--cal-tokens", type=int_at_least(2), default=32768, help="held-out calibration tokens")
    ap.add_argument("--context", type=int_at_least(2), default=512)
    ap.add_argument("--batch-size", type=int_at_least(1), default=None, help="windows per forward (64 GPU, 4 CPU)")
    ap.add_argument("--budget", type=positive_real, default=0.005)
    ap.add_argument("--budget-steps", type=int_at_least(0), default=5)
    ap.add_argument("--targets", type=reductions, default="0.1,0.25,0.4", help="matched-compute reductions")
    ap.add_argument("--resamples", type=int_at_least(1), default=2000)
    ap.add_argument("--bootstrap-seed", type=int_at_least(0), default=0)
    ap.add_argument("--train", type=json.loads, default={},
                    help="JSON of tools/train.py options over the shipped recipe (a CPU test's micro size only)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--time-limit", type=float, default=0.0,
                    help="seconds: start no (model, seed) after it and stop the running ones at it (0: none)")
    ap.add_argument("--resume", action="store_true", help="keep the (model, seed) rows of the topic's file")
    ap.add_argument("--topic", default="seeds")
    ap.add_argument("--one", nargs=2, metavar=("MODEL", "SEED"), help=argparse.SUPPRESS)  # a worker
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args.batch_size = args.batch_size or (64 if args.device.startswith("cuda") else 4)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in names if m not in models.TINY]
    if bad or not names:
        ap.error(f"argument --models: {bad or names} must be embedded models {list(models.NAMES)}")
    if not isinstance(args.train, dict):
        ap.error(f"argument --train: {args.train!r} must be a JSON object of tools/train.py options")
    parts = args.out / "parts"
    if args.one:
        model, seed = args.one[0], int(args.one[1])
        write_json(parts / f"{model}-s{seed}.json", one(model, seed, args))
        return 0

    protocol = {k: v for k, v in vars(args).items() if k not in ("models", "workers", "out", "device", "time_limit",
                                                                 "resume", "one")}
    protocol["targets"] = list(args.targets)
    target, kept = results_dir() / f"{args.topic}.json", args.out / f"{args.topic}.json"  # kept: beside the weights
    rows, done, timings = [], [], []
    source = target if target.exists() else kept  # a fresh results folder (a device call's) resumes from --out
    if args.resume and source.exists():
        doc = read_file(source)
        if doc.get("protocol") != protocol:
            ap.error(f"--resume {source}: another protocol ({doc.get('protocol')}, here {protocol})")
        rows, done, timings = doc["rows"], [tuple(d) for d in doc["done"]], doc.get("timings", [])
        for r in rows:  # rows of a file written before rows named their machine: that file's
            r.setdefault("device", doc["machine"]["device"])
            r.setdefault("commit", doc["commit"])
    new = {m: seeds_for(m, args.seeds) for m in names}  # trainings first, the models in turn; then the shipped
    todo = [(m, new[m][i]) for i in range(args.seeds) for m in names] + [(m, shipped_seed(m)) for m in names]
    todo = [j for j in todo if j not in done]
    t_all, running = time.perf_counter(), {}
    notes = (f"Training seeds: each model trained again ({args.seeds} seeds other than the shipped checkpoint's, "
             f"tools/train.py's shipped recipe{', with ' + json.dumps(args.train) if args.train else ''}) and, with "
             "the shipped checkpoint, evaluated by moelab.paper.paper_rows on the first "
             f"{args.eval_tokens} tokens of WikiText-2 test (context and stride {args.context}), thresholds "
             f"calibrated on {args.cal_tokens} held-out tokens: section matched (every rule at targets "
             f"{list(args.targets)} and the budget point), calibrated (budget {args.budget:+.1%}), comparison "
             "(every pair of rules at each matched level, moelab.calibrate.compare_rules). Intervals: 95% paired "
             f"bootstrap over windows ({args.resamples} resamples, seed {args.bootstrap_seed}). seed: the training "
             "seed; shipped: the committed checkpoint. Weights are not kept: the training command rebuilds them.")

    def save():
        path = write_results(args.topic, rows, notes=notes,
                             extra={"protocol": protocol, "done": [list(d) for d in done], "timings": timings,
                                    "wall_s": time.perf_counter() - t_all,
                                    "complete": len(done) == sum(len(new[m]) + 1 for m in names)})
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, kept)

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "lib"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:])]
    while todo or running:
        out_of_time = args.time_limit and time.perf_counter() - t_all > args.time_limit
        while todo and len(running) < args.workers and not out_of_time:
            job = todo.pop(0)
            (parts / f"{job[0]}-s{job[1]}.json").unlink(missing_ok=True)
            running[job] = subprocess.Popen([*cmd, "--one", job[0], str(job[1])], env=env)
            log.info("started %s seed %d", *job)
        if out_of_time:
            for job, proc in running.items():  # its training state stays in --out for a resumed call
                proc.terminate()
                log.warning("time limit: stopped %s seed %d", *job)
            todo, running = [], {}
            break
        time.sleep(1)
        for job, proc in list(running.items()):
            if proc.poll() is None:
                continue
            del running[job]
            if proc.returncode:
                for other in running.values():
                    other.terminate()
                save()
                raise SystemExit(f"{job[0]} seed {job[1]}: worker failed (exit {proc.returncode})")
            part = read_json(parts / f"{job[0]}-s{job[1]}.json")
            rows += part["rows"]
            done.append(job)
            timings.append({k: part[k] for k in ("model", "seed", "train_s", "eval_s")})
            log.info("%s seed %d done: train %.0fs, evaluate %.0fs", job[0], job[1], part["train_s"], part["eval_s"])
            save()
    save()
    left = [(m, s) for m in names for s in [*new[m], shipped_seed(m)] if (m, s) not in done]
    print(f"wrote {target}: {len(done)} (model, seed) done" + (f", left for --resume: {left}" if left else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
