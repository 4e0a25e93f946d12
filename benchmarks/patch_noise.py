"""The patching noise floor: perplexity unchanged and with the model's own top-k routed through moelab.

For each embedded model (or local checkpoint), token count and batch size: the unchanged model's perplexity,
the perplexity with every MoE block patched to TopK(native k), and the unchanged model's with transformers'
reference expert loop ('eager', the paper tables' baseline) in place of its default experts, on the first
--tokens tokens of WikiText-2 test (`data.eval_text()`, windows of the model's context that do not overlap), in
--dtype (the library's default: fp32 on the CPU, bf16 on CUDA). Any gap is floating-point noise, not routing: it
bounds what a routing change's perplexity can be told apart from in that dtype.
Writes the results topic patch-noise.

    PYTHONPATH=lib python benchmarks/patch_noise.py            # CPU, about a minute
    PYTHONPATH=lib python benchmarks/patch_noise.py --tokens 512,16384 --dtype float32,bfloat16   # CPU, about 3 min
    PYTHONPATH=lib python benchmarks/patch_noise.py --device cuda --dtype float32,bfloat16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from moelab import models
from moelab.data import eval_text
from moelab.evaluate import evaluate, perplexity
from moelab.hf import moe_layers, record_router
from moelab.results import write_results
from moelab.routing import TopK

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_kernels import ints_at_least  # noqa: E402


def ties_at_k(model, ids: torch.Tensor, context: int) -> tuple[int, int]:
    """(routed token-layers whose router probabilities tie exactly at the k-th place, routed token-layers) in the
    unchanged model: there moelab takes the lower expert index and torch.topk either (softmax in fp32 of the
    logits in the model's dtype, as the models; bf16 logits tie far more often than fp32 ones)."""
    with record_router(model, logits=True) as rec:
        perplexity(model, None, ids, context=context, stride=context, batch_size=1, progress=False)
    ties = total = 0
    for layer in moe_layers(model):
        p_TE = torch.softmax(rec.router_logits(layer.index).float(), dim=-1)
        top_TK = p_TE.topk(layer.native_k + 1, dim=-1).values
        ties += int((top_TK[:, -2] == top_TK[:, -1]).sum())
        total += p_TE.shape[0]
    return ties, total


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(models.NAMES), help="comma list of embedded names or checkpoint paths")
    ap.add_argument("--tokens", type=ints_at_least(2), default="16384",
                    help="comma list of counts: the first tokens of WikiText-2 test")
    ap.add_argument("--batches", type=ints_at_least(1), default="1,8", help="comma list of windows per forward")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    ap.add_argument("--dtype", default="auto",
                    help=f"comma list of auto (bf16 on CUDA, fp32 on the CPU) or {', '.join(models.DTYPES)}")
    args = ap.parse_args(argv)
    try:
        args.device = str(models.pick_device(args.device))
    except ValueError as e:
        ap.error(f"argument --device: {e}")
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    if not names:
        ap.error("argument --models: no model named")
    for name in names:
        try:
            models.resolve(name)
        except (ValueError, FileNotFoundError) as e:
            ap.error(f"argument --models: {e}")
    dtypes = []
    for d in (d.strip() for d in args.dtype.split(",")):
        try:
            dtypes.append(models.pick_dtype(d, torch.device(args.device)))
        except ValueError as e:
            ap.error(f"argument --dtype: {e}")
    if len(set(args.tokens)) != len(args.tokens):
        ap.error(f"argument --tokens: {args.tokens}: a count named twice")
    rows = []
    for name, dtype in tqdm([(n, d) for n in names for d in dtypes], desc="models"):
        model, tok = models.load(name, device=args.device, dtype=dtype)
        text_ids = tok(eval_text(), add_special_tokens=False)["input_ids"]
        native_k = moe_layers(model)[0].native_k
        default_experts = getattr(model.config, "_experts_implementation", None)
        for count in args.tokens:
            ids = torch.tensor(text_ids[:count])
            ties, routed = ties_at_k(model, ids, 2048)
            for batch in args.batches:
                kw = {"context": 2048, "stride": 2048, "batch_size": batch, "progress": False}
                base = evaluate(model, None, ids, **kw).summary
                same = evaluate(model, TopK(native_k), ids, baseline_ppl=base["ppl"], **kw).summary
                reference = models.reference_experts(model)
                try:
                    loop = evaluate(model, None, ids, baseline_ppl=base["ppl"], **kw).summary
                finally:
                    if default_experts is not None and reference != default_experts:
                        model.set_experts_implementation(default_experts)
                rows.append({"model": name, "device": str(model.device),
                             "dtype": str(dtype).removeprefix("torch."), "batch_size": batch, "tokens": ids.numel(),
                             "scored_tokens": base["scored_tokens"], "context": base["context"],
                             "native_k": native_k, "ppl_unchanged": base["ppl"], "ppl_native_topk": same["ppl"],
                             "ppl_change": same["ppl_change"], "mean_k": same["mean_k"],
                             "experts_default": default_experts, "experts_reference": reference,
                             "ppl_unchanged_reference": loop["ppl"], "reference_change": loop["ppl_change"],
                             "ppl_change_vs_reference": same["ppl"] / loop["ppl"] - 1,
                             "ties_at_k": ties, "routed_token_layers": routed})
                print({k: rows[-1][k] for k in ("model", "dtype", "tokens", "batch_size", "ppl_change",
                                                "reference_change", "ties_at_k")})
    path = write_results("patch-noise", rows, notes=(
        "Perplexity of the unchanged model and of the model with every MoE block patched to TopK(native k) by "
        "moelab.hf, on the first tokens of WikiText-2 test with LF line ends, windows of the model's context (clipped "
        "from 2048) that do not overlap, in the model dtype of each row (column dtype); "
        "per-token losses summed in fp64. ppl_change is relative. "
        "ppl_unchanged_reference: the unchanged model with transformers' reference expert loop "
        "(experts_reference, 'eager') in place of its default experts (experts_default); reference_change: "
        "its change against ppl_unchanged; ppl_change_vs_reference: the patched TopK against it. "
        "ties_at_k: routed token-layers of the unchanged model "
        "whose router probabilities (fp32 softmax of logits in the row's dtype) "
        "tie exactly at the k-th place (there moelab takes the lower expert index, "
        "torch.topk either), of routed_token_layers."))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
