"""Retrain embedded models with stronger router load-balancing losses; say which keep every layer balanced.

Each (model, coefficient) trains with `python -m moelab.train --overrides '{"router_aux_loss_coef": c}'`
(everything else the registry's defaults), all in parallel on one GPU, then `--card` evaluates it on
the CPU in fp32, as the committed cards were: the expert-load entropy per layer on held-out text no
model trained on (`data.heldout_texts()`), the held-out losses and WikiText-2 test perplexity on a
slice. The committed checkpoint of each model is evaluated the same way beside them. Writes
`router-balance-<date>.json` to --out-dir and picks, per model, the candidate with the lowest mean
held-out loss among those whose lowest layer reaches --min-entropy.

    python data/results/trials/router_balance.py --work /tmp/rb --out-dir $OUT \
        --candidates tiny-mixtral:0.05,0.1,0.2 tiny-qwen-moe:0.03,0.05,0.1

`--train-args "--balance per-layer"` trains with the balancing loss taken per layer (`moelab.train.balance_loss`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from moelab.results import REPO, write_results

CARD_TOKENS = 131072  # the committed cards' test slice


def run(cmd: list[str], log: Path, threads: int = 0) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=REPO)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", required=True, help="folder for the candidate checkpoints")
    p.add_argument("--out-dir", default=None, help="results folder (default data/results)")
    p.add_argument("--candidates", nargs="+", required=True, help="model:coef,coef,...")
    p.add_argument("--min-entropy", type=float, default=0.82)
    p.add_argument("--card-tokens", type=int, default=CARD_TOKENS)
    p.add_argument("--seeds", default="0", help="training seeds, comma-separated: every candidate with each")
    p.add_argument("--no-committed", action="store_true", help="do not evaluate the committed checkpoints")
    p.add_argument("--train-args", default="", help="more moelab.train options (a smoke test: '--max-steps 2')")
    a = p.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    jobs = {}
    for spec in a.candidates:
        model, coefs = spec.split(":")
        for c in coefs.split(","):
            for seed in a.seeds.split(","):
                tag = f"{c}" if seed == "0" else f"{c}-s{seed}"
                out = work / f"{model}-{tag}"
                over = json.dumps({"router_aux_loss_coef": float(c)})
                train = [py, "-m", "moelab.train", "--model", model, "--out", str(out), "--overrides", over,
                         "--seed", seed, *a.train_args.split()]
                jobs[(model, tag)] = (out, run(train, work / f"{model}-{tag}.train.log"))
    for (model, c), (_, proc) in jobs.items():
        if proc.wait() != 0:
            raise SystemExit(f"training {model} coef {c} failed: {work / f'{model}-{c}.train.log'}")
    n_cards = len(jobs) + (0 if a.no_committed else len({m for m, _ in jobs}))
    threads = max(1, (os.cpu_count() or 2) // n_cards)  # the cards evaluate on the CPU in fp32, as committed
    cards = {key: run([py, "-m", "moelab.train", "--card", "--out", str(out), "--card-tokens", str(a.card_tokens)],
                      work / f"{key[0]}-{key[1]}.card.log", threads) for key, (out, _) in jobs.items()}
    for model in () if a.no_committed else dict.fromkeys(m for m, _ in jobs):  # the committed, the same way
        committed = work / f"{model}-committed"
        subprocess.run(["cp", "-rL", str(REPO / "data" / "models" / model), str(committed)], check=True)
        cards[(model, "committed")] = run([py, "-m", "moelab.train", "--card", "--out", str(committed),
                                           "--card-tokens", str(a.card_tokens)], work / f"{model}-committed.card.log",
                                          threads)
    for key, proc in cards.items():
        if proc.wait() != 0:
            raise SystemExit(f"card of {key} failed")
    rows = []
    for (model, c) in cards:
        folder = work / f"{model}-{c}"
        ev = json.loads((folder / "eval.json").read_text())
        tlog = json.loads((folder / "train_log.json").read_text())
        ent = ev["router"]["load_entropy"]
        rows.append({"model": model, "router_aux_loss_coef": tlog["model_config"].get("router_aux_loss_coef"),
                     "checkpoint": "committed" if c == "committed" else "candidate",
                     "seed": tlog["config"]["seed"], "balance": tlog["config"].get("balance", "model"),
                     "load_entropy": ent, "min_load_entropy": min(ent),
                     # reported, never used to pick: the evaluation text's first tokens
                     "test_load_entropy": (ev.get("router_test") or {}).get("load_entropy"),
                     "heldout_loss": ev.get("heldout_loss"), "test_ppl_slice": ev["wikitext2_test"]["ppl"],
                     "best_val_loss": tlog["best_val_loss"], "best_step": tlog["best_step"],
                     "train_wall_s": tlog["wall_time_s"], "train_commit": tlog.get("commit"), "folder": folder.name})
    picks = {}
    for model in dict.fromkeys(r["model"] for r in rows):
        ok = [r for r in rows if r["model"] == model and r["checkpoint"] == "candidate"
              and r["min_load_entropy"] >= a.min_entropy]
        mean_loss = lambda r: sum(r["heldout_loss"].values()) / len(r["heldout_loss"])  # noqa: E731
        picks[model] = min(ok, key=mean_loss)["folder"] if ok else None
    notes = (f"candidates trained with {a.train_args or 'the defaults'} in parallel on one GPU; cards from "
             f"`python -m moelab.train --card --card-tokens {a.card_tokens}` on the same machine (CPU, fp32); pick: "
             f"lowest mean held-out loss among candidates whose lowest layer load entropy >= {a.min_entropy}")
    path = write_results("router-balance", rows, notes=notes, out_dir=a.out_dir, extra={"picks": picks})
    print(json.dumps({"picks": picks, "results": str(path)}))
    for r in rows:
        print(r["folder"], [round(x, 3) for x in r["load_entropy"]], r["heldout_loss"], round(r["test_ppl_slice"], 1),
              "test:", [round(x, 3) for x in r["test_load_entropy"] or []])


if __name__ == "__main__":
    main()
