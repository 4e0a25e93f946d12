"""The paper's tables on the embedded models: WikiText-2 test perplexity with routing really changed.

For each model: the unchanged baseline, the model's own TopK through moelab (noise floor), the published
configurations, thresholds calibrated (on held-out text) to the PR's claimed reduction, thresholds
calibrated to a +0.5% perplexity budget (shared and per-layer, and to a tighter budget as a margin), and the
rules at matched compute (EntropyAdaptiveK, TopP, RatioSkip, SER, per-layer budgets spread evenly or by
sensitivity, Lu et al.'s median ratio, lower fixed k), each row with KL and top-1 agreement against the unchanged
model, its windows' NLLs and a paired bootstrap interval; with --domains the same (but the published
configurations and the budget points) on texts of other domains. Writes the results topic paper-tables
(moelab.results) with the matched comparisons between every pair of rules (extra `comparisons`), and the rows'
per-window lists in the sidecar paper-tables.npz beside it.

GPU (the full protocol, about 5-6 minutes on one H100; a run cut short is finished with --resume):
    PYTHONPATH=lib PYTHONUNBUFFERED=1 python benchmarks/paper_tables.py --targets 0.1,0.25,0.4 --budget-steps 5 \
        --domains all --domain-tokens 131072
CPU smoke run (end to end on slices; writes topic paper-tables-smoke):
    python benchmarks/paper_tables.py --max-tokens 512 --cal-tokens 512 --budget-steps 2 --targets 0.25 \
        --domains all --domain-tokens 512 --resamples 200
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

from moelab.calibrate import calibration_ids
from moelab.data import UNSEEN_TEXTS, eval_text, unseen_texts
from moelab.models import NAMES, reference_experts, resolve
from moelab.paper import paper_rows, paper_table
from moelab.results import _check_stem, commit, read_file, results_dir, write_results

log = logging.getLogger("paper_tables")


def load_model(name: str, device: str, dtype: torch.dtype, random_init: bool, device_map: str | None = None):
    from moelab import models

    if not random_init:
        return models.load(name, device=device, dtype=dtype, device_map=device_map)
    from transformers import AutoTokenizer

    model = models.build(name).to(device=device, dtype=dtype).eval()
    return model, AutoTokenizer.from_pretrained(models.tokenizer_dir())


def int_at_least(lo: int):
    """An argparse type: an int >= lo."""
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            v = None
        if v is None or v < lo:
            raise argparse.ArgumentTypeError(f"{s!r}: must be an int >= {lo}")
        return v
    return parse


def positive_real(s: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        v = float(s)
    except ValueError:
        v = float("nan")
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"{s!r}: must be a number > 0")
    return v


def reductions(s: str) -> tuple[float, ...]:
    """--targets: a comma list of numbers in (0, 1) (empty items skipped, as before; at least one)."""
    out = []
    for t in (t for t in s.split(",") if t.strip()):
        try:
            v = float(t)
        except ValueError:
            v = None
        if v is None or not 0 < v < 1:
            raise argparse.ArgumentTypeError(f"{s!r}: {t.strip()!r} is not a number in (0, 1) (comma list of "
                                             "routed-expert reductions)")
        out.append(v)
    if not out:
        raise argparse.ArgumentTypeError(f"{s!r}: no reduction given (comma list of numbers in (0, 1))")
    return tuple(out)


def domain_names(s: str) -> tuple[str, ...]:
    """--domains: 'all', '' (none) or a comma list of moelab.data.UNSEEN_TEXTS."""
    names = UNSEEN_TEXTS if s.strip() == "all" else tuple(n.strip() for n in s.split(",") if n.strip())
    bad = [n for n in names if n not in UNSEEN_TEXTS]
    if bad:
        raise argparse.ArgumentTypeError(f"{s!r}: {bad} unknown; 'all' or a comma list of {list(UNSEEN_TEXTS)}")
    return names


def fractions(s: str) -> tuple[float, ...]:
    """--margins: a comma list of numbers in (0, 1), or '' for none."""
    return reductions(s) if s.strip() else ()


def train_seed(name: str, random_init: bool) -> int | None:
    """The training seed in the checkpoint's train_log.json (None: none recorded, or an untrained model)."""
    log_file = None if random_init else resolve(name) / "train_log.json"
    if log_file is None or not log_file.exists():
        return None
    return json.loads(log_file.read_text()).get("config", {}).get("seed")


def check_models(ap, names: list[str], random_init: bool) -> None:
    """Every --models entry names a checkpoint (or, with --random-init, a registry name or family)."""
    from moelab import models

    if not names:
        ap.error("argument --models: no model named")
    for name in names:
        if random_init:
            if name not in models.TINY and name not in models.FAMILIES:
                ap.error(f"argument --models: {name!r}: with --random-init must be one of "
                         f"{sorted({*models.TINY, *models.FAMILIES})}")
            continue
        try:
            models.resolve(name)
        except (ValueError, FileNotFoundError) as e:
            ap.error(f"argument --models: {e}")


def check_output(ap, topic: str) -> None:
    """The results file can be written: a plain topic stem and a writable results directory."""
    try:
        _check_stem("topic", topic)
    except ValueError as e:
        ap.error(f"argument --topic: {e}")
    out = results_dir()
    try:
        out.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out).close()
    except OSError as e:
        ap.error(f"results directory {out} (MOELAB_RESULTS_DIR): not writable ({e})")


def resume_from(path: Path, topic: str, protocol: dict, names: list[str]):
    """Rows, traces and verdicts of the models an earlier run finished, and the record of that run.

    Refused unless it is the same topic, commit and protocol (every option but --models, --device,
    --device-map and --resume), so one file never mixes code or settings; its models must be among --models.
    """
    doc = read_file(path)
    here = commit()
    if here == "unknown" or here.endswith(("-dirty", "-unverified")):
        raise SystemExit(f"--resume {path}: this tree's commit is {here!r}; resume only from a committed, clean "
                         "tree (or set MOELAB_COMMIT), so that both parts name the code they ran")
    problems = [f"{key} {doc.get(key)!r}, here {want!r}" for key, want in (("topic", topic), ("commit", here))
                if doc.get(key) != want]
    theirs = doc.get("protocol") or {}
    problems += [f"{key} {theirs.get(key)!r}, here {protocol[key]!r}" for key in protocol
                 if theirs.get(key) != protocol[key]]
    extra = [m for m in doc.get("models_done", []) if m not in names]
    if extra:
        problems.append(f"models {extra} are not in --models {names}")
    if problems:
        raise SystemExit(f"--resume {path}: not the same run: " + "; ".join(problems))
    done = list(doc.get("models_done", []))
    rows = [r for r in doc["rows"] if r.get("model") in done]
    traces = [t for t in doc.get("traces", []) if t.get("model") in done]
    verdicts = {m: doc["verdicts"][m] for m in done}
    comparisons = [c for c in doc.get("comparisons", []) if c.get("model") in done]
    weights = {m: w for m, w in doc.get("weights", {}).items() if m in done}
    prior = [*doc.get("resumed_from", []),
             {k: doc.get(k) for k in ("created", "commit", "command", "machine", "wall_s", "models_done")}]
    return rows, traces, verdicts, weights, prior, comparisons


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(NAMES), help="comma-separated names or checkpoint paths")
    ap.add_argument("--max-tokens", type=int_at_least(2), default=None,
                    help="evaluation tokens (default: all of WikiText-2 test)")
    ap.add_argument("--cal-tokens", type=int_at_least(2), default=32768,
                    help="held-out calibration tokens (equal shares)")
    ap.add_argument("--context", type=int_at_least(2), default=2048, help="window (clipped to the model's context)")
    ap.add_argument("--stride", type=int_at_least(1), default=512)
    ap.add_argument("--batch-size", type=int_at_least(1), default=None,
                    help="windows per forward (default: 64 GPU, 4 CPU)")
    ap.add_argument("--budget", type=positive_real, default=0.005, help="relative perplexity budget for calibration")
    ap.add_argument("--budget-steps", type=int_at_least(0), default=6, help="bisection steps of the budget search")
    ap.add_argument("--targets", type=reductions, default="0.1,0.2,0.3,0.4",
                    help="matched-compute routed-expert reductions, each in (0, 1)")
    ap.add_argument("--no-per-layer", action="store_true", help="skip per-layer threshold calibration")
    ap.add_argument("--margins", type=fractions, default="0.5",
                    help="also calibrate to budget x each of these (a margin for other domains; '' for none)")
    ap.add_argument("--domains", type=domain_names, default="",
                    help=f"texts of other domains to evaluate on too: 'all' or a comma list of {list(UNSEEN_TEXTS)}")
    ap.add_argument("--domain-tokens", type=int_at_least(2), default=None,
                    help="only the first N tokens of each domain text (default: all)")
    ap.add_argument("--resamples", type=int_at_least(1), default=2000, help="paired bootstrap resamples")
    ap.add_argument("--bootstrap-seed", type=int_at_least(0), default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="float32 keeps the patched native TopK within 1e-5 of the unchanged model; in 16-bit the "
                         "patch alone moves perplexity by up to about 3e-4: read ppl_change_vs_patched")
    ap.add_argument("--device-map", default=None,
                    help="'auto': spread a model too large for one GPU over all of them (accelerate); --device unused")
    ap.add_argument("--random-init", action="store_true", help="untrained models (plumbing check only)")
    ap.add_argument("--topic", default=None, help="results topic (default paper-tables, -smoke with --max-tokens)")
    ap.add_argument("--resume", type=Path, default=None,
                    help="results file of an earlier run cut short (same commit and protocol): keep its models, "
                         "run the rest")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    dtype = getattr(torch, args.dtype)
    batch = args.batch_size or (64 if args.device.startswith("cuda") else 4)
    targets = args.targets
    topic = args.topic or ("paper-tables" + ("-random" if args.random_init else "")
                           + ("-smoke" if args.max_tokens else ""))
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    check_models(ap, names, args.random_init)
    check_output(ap, topic)
    text = eval_text()
    rows, traces, verdicts, comparisons, t_all = [], [], {}, [], time.perf_counter()
    domain_text = unseen_texts() if args.domains else {}
    notes = (
        f"WikiText-2 test with LF line ends (moelab.data.eval_text; "
        f"{'first ' + str(args.max_tokens) + ' tokens' if args.max_tokens else 'all tokens'}), "
        f"sliding window context {args.context} (clipped to each model's max_position_embeddings) stride "
        f"{args.stride}, {args.dtype}. Every perplexity comes from forwards whose MoE blocks were patched by "
        "moelab.hf (routing changed, skipped pairs not computed), except section=baseline (the unchanged model). "
        "ppl_change is against the unchanged model, ppl_change_vs_patched against the patched native TopK (the one "
        "to read in 16-bit, where the patch alone moves perplexity). "
        "mean_k counts kept pairs over every forwarded position; expert_reduction against the native k; "
        "forward_reduction from moelab.compute.ModelShapes. Thresholds are calibrated on held-out slices of the "
        f"training corpora ({args.cal_tokens} tokens, equal shares), never on the evaluation text; "
        "est_expert_reduction is the estimate from recorded router outputs on that calibration text. "
        f"Budget {args.budget:+.2%} relative perplexity, {args.budget_steps} bisection steps, margins "
        f"{list(args.margins)} (calibrated again to budget x margin). "
        f"Other domains: {list(args.domains) or 'none'}"
        + (f" (first {args.domain_tokens} tokens of each)" if args.domain_tokens else "") + " (text column). "
        "kl (nats/token) and top1_agree are against the unchanged model's next-token distribution, on the same "
        "tokens; window_nll (rounded to 0.01 nats) and window_tokens give each window's NLL sum and scored tokens "
        f"(kept in the sidecar {topic}.npz beside this file; moelab.results.read_file puts them back in the rows); "
        f"ci_lo / ci_hi: 95% paired bootstrap intervals over windows ({args.resamples} resamples, seed "
        f"{args.bootstrap_seed}); extra comparisons: every pair of rules at each matched level "
        "(moelab.calibrate.compare_rules). train_seed: the checkpoint's training seed. "
        + ("RANDOM-INIT MODELS: plumbing check, not a result. " if args.random_init else "")
        + "Claimed numbers (pr_*, paper_*) are copied from the claims under test, not measured."
    )

    # the settings as used (not as typed), so the same run spelled differently still resumes
    protocol = {k: v for k, v in vars(args).items() if k not in ("models", "device", "device_map", "resume")}
    protocol.update(batch_size=batch, topic=topic, targets=list(targets), max_tokens=args.max_tokens or None,
                    line_ends="LF",  # runs before eval_text() (no line_ends) read the shipped copy's CRLF
                    margins=list(args.margins), domains=list(args.domains))
    weights = {}  # model -> moelab.models.fingerprint of the weights its rows came from
    resumed = []
    if args.resume is not None:
        rows, traces, verdicts, weights, resumed, comparisons = resume_from(args.resume, topic, protocol, names)
        log.info("resuming %s: keeping %s", args.resume, ", ".join(verdicts) or "nothing")

    def save(done: list[str]):
        # rewritten after every model, so a run cut short keeps the models it finished
        extra = {"protocol": protocol, "weights": weights, "traces": traces, "verdicts": verdicts,
                 "comparisons": comparisons,
                 "wall_s": time.perf_counter() - t_all,
                 "models_done": done, "complete": set(done) >= set(names)}
        if resumed:
            extra["resumed_from"] = resumed
        return write_results(topic, rows, notes=notes, extra=extra, apart=("window_nll", "window_tokens"))

    path = None
    for name in names:
        if name in verdicts:
            continue
        t0 = time.perf_counter()
        model, tok = load_model(name, args.device, dtype, args.random_init, args.device_map)
        if not args.random_init:
            from moelab.models import fingerprint

            weights[name] = fingerprint(name)
        reference_experts(model)  # the baseline runs transformers' reference expert loop
        eval_ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
        if args.max_tokens:
            eval_ids = eval_ids[: args.max_tokens]
        cal_ids = calibration_ids(tok, args.cal_tokens)
        domains = {d: torch.tensor(tok(domain_text[d], add_special_tokens=False)["input_ids"][: args.domain_tokens],
                                   dtype=torch.long) for d in args.domains}
        out = paper_rows(model, name, eval_ids, cal_ids, context=args.context, stride=args.stride, batch_size=batch,
                         budget=args.budget, budget_steps=args.budget_steps, targets=targets,
                         per_layer=not args.no_per_layer, progress=True, domains=domains, margins=args.margins,
                         resamples=args.resamples, bootstrap_seed=args.bootstrap_seed,
                         train_seed=train_seed(name, args.random_init))
        comparisons += out["comparisons"].to_dict("records")
        for r in out["rows"]:
            r["model_wall_s"] = None
        out["rows"][0]["model_wall_s"] = time.perf_counter() - t0
        rows += out["rows"]
        traces += out["traces"].to_dict("records")
        verdicts[name] = out["verdict"]
        log.info("%s done in %.1fs: %s", name, time.perf_counter() - t0, out["verdict"])
        path = save(list(verdicts))
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    if path is None:  # every model came from --resume
        path = save(list(verdicts))
    table = paper_table(rows)
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(table.iloc[:, :10].to_string(index=False))
    for name, v in verdicts.items():
        print(f"\n{name}: {v}")
    print(f"\nwrote {path} ({time.perf_counter() - t_all:.0f}s)")


if __name__ == "__main__":
    main()
