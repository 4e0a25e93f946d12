"""What the shipped WikiText-2 test copy's CRLF line ends do to perplexity (why `data.eval_text()` makes them LF).

For each embedded model: the unchanged model's perplexity on the first --chars characters of the test file as
shipped (every line ends in CRLF) and with LF line ends, the mean loss at the CRLF token itself, and the
perplexity of the CRLF stream without those targets. Windows of 512 that do not overlap, fp32.
Writes the results topic eval-text-lines.

    PYTHONPATH=lib python benchmarks/eval_text_lines.py            # CPU, about a minute
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from moelab import models
from moelab.data import EVAL_TEXT, load_text
from moelab.results import write_results

CRLF = "\r\n"


def losses(model, ids: torch.Tensor, context: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(next-token loss, target id) of every position after a window's first, windows of `context`."""
    n = (ids.numel() - 1) // context * context
    if n == 0:
        raise SystemExit(f"{ids.numel()} tokens: fewer than one window of --context {context}; raise --chars")
    x_WL = ids[:n].view(-1, context)
    out = []
    with torch.no_grad():
        for i in range(0, x_WL.shape[0], batch):
            b = x_WL[i : i + batch]
            logits = model(input_ids=b).logits.float()
            out.append(F.cross_entropy(logits[:, :-1].flatten(0, 1), b[:, 1:].flatten(), reduction="none"))
    return torch.cat(out), x_WL[:, 1:].flatten()


def positive_int(s: str) -> int:
    """An argparse type: an int >= 1."""
    try:
        v = int(s)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"{s!r}: must be an int >= 1")
    return v


def check_models(ap, names: list[str], context: int) -> None:
    """Every name is a checkpoint whose trained context holds --context (configs only: no weights loaded)."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    for name in names:
        try:
            path = models.resolve(name)
        except (ValueError, FileNotFoundError) as e:
            ap.error(f"argument --models: {e}")
        most = models.model_context(SimpleNamespace(config=AutoConfig.from_pretrained(path)))
        if most is not None and context > most:
            ap.error(f"argument --context: {context} is past {name}'s trained context ({most} positions)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(models.NAMES))
    ap.add_argument("--chars", type=int, default=200_000)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batch", type=positive_int, default=8)
    args = ap.parse_args(argv)
    if args.chars < 1000 or args.context < 2:
        raise SystemExit(f"--chars {args.chars} / --context {args.context}: need >= 1000 / >= 2")
    names = args.models.split(",")
    check_models(ap, names, args.context)
    raw = load_text(EVAL_TEXT)[: args.chars]
    rows = []
    for name in tqdm(names, desc="models"):
        model, tok = models.load(name)
        crlf_id = tok.convert_tokens_to_ids(tok.tokenize(CRLF))  # one token in the embedded tokenizer
        for lines, text in (("crlf", raw), ("lf", raw.replace(CRLF, "\n"))):
            ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
            loss, tgt = losses(model, ids, args.context, args.batch)
            at = (tgt == crlf_id[0]) if len(crlf_id) == 1 else torch.zeros_like(tgt, dtype=torch.bool)
            rows.append({
                "model": name, "lines": lines, "device": str(model.device), "chars": len(text), "tokens": ids.numel(),
                "scored_tokens": loss.numel(), "ppl": math.exp(loss.mean().item()),
                "crlf_targets": int(at.sum()), "crlf_token_ids": crlf_id,
                "crlf_mean_loss": loss[at].mean().item() if at.any() else None,
                "ppl_without_crlf_targets": math.exp(loss[~at].mean().item()),
            })
            print({k: rows[-1][k] for k in ("model", "lines", "tokens", "ppl", "crlf_targets", "crlf_mean_loss")})
    path = write_results("eval-text-lines", rows, notes=(
        f"First {args.chars} characters of {EVAL_TEXT} as shipped (CRLF line ends) and with LF line ends; unchanged "
        f"models, fp32, windows of {args.context} that do not overlap (a window's first token not scored)."))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
