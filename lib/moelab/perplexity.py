"""Sliding-window perplexity over one token stream (the usual WikiText-2 protocol of the HF docs).

Windows of `context` tokens start every `stride` tokens; each window scores only the tokens that no
earlier window scored. A window's first token has no prediction inside it, so:
- stride < context: every token after the first is scored exactly once, each with at least
  `context - stride` tokens of left context (fewer only in the first window);
- stride = context: the windows do not overlap and each window's first token goes unscored (the HF
  docs' protocol with stride = max_length): n - windows tokens are scored (one fewer where a last window
  would hold a single token: it has nothing to score and is not run), `scored_tokens` says so.
The context is clipped to the model's `max_position_embeddings`, and the stride to the clipped context
(so 2048 / 512 on a model of at most 512 positions becomes 512 / 512: no overlap); the result records
both. Only the scored positions' logits are computed (`logits_to_keep`); the per-token losses are computed in fp32
and summed in fp64.
"""

from __future__ import annotations

import inspect
import math
import numbers

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from moelab.models import as_ids, check_ids, input_device, model_context

__all__ = ["perplexity", "windows", "token_ids"]


def token_ids(tokenizer, text_or_ids) -> torch.Tensor:
    """A 1-D int64 token stream from a text (needs a tokenizer) or from token ids (list or tensor)."""
    if isinstance(text_or_ids, str):
        if tokenizer is None:
            raise ValueError("text given as a str but tokenizer=None: pass a tokenizer or token ids")
        ids = tokenizer(text_or_ids, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.long)
    ids = as_ids(text_or_ids, "text_or_ids", "a str (with a tokenizer) or token ids")
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"token ids of shape {tuple(ids.shape)}: must be one stream, shape [N] or [1, N]")
    if ids.numel() == 0:  # before the dtype check: torch.as_tensor([]) is float32
        return ids.long()
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"token ids of dtype {ids.dtype}: must be integers")
    return ids.long()


def windows(n_tokens: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, scored) of every window: input ids[begin:end], the last `scored` tokens scored."""
    if context < 2:
        raise ValueError(f"context={context}: must be >= 2")
    if not 1 <= stride <= context:
        raise ValueError(f"stride={stride}: must be in [1, context={context}]")
    out, prev_end = [], 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + context, n_tokens)
        # new tokens only; a window's first token has no prediction inside it
        scored = min(end - prev_end, end - begin - 1)
        if scored > 0:
            out.append((begin, end, scored))
        prev_end = end
        if end == n_tokens:
            break
    return out


@torch.no_grad()
def perplexity(
    model,
    tokenizer,
    text_or_ids,
    context: int = 2048,
    stride: int = 512,
    max_tokens: int | None = None,
    batch_size: int = 1,
    progress: bool = True,
) -> dict:
    """Perplexity of a causal LM on one token stream, sliding window (see the module docstring).

    Returns dict(ppl, nll [nats/token], scored_tokens, context and stride [after clipping], windows, and for
    compute counts the windows' forwarded_tokens, attended_mean (a forwarded token's mean attended length) and
    longest_window (shorter than context where the text is)).
    max_tokens: score only the first max_tokens tokens of the stream (None: all).
    batch_size: windows of equal shape run together (no padding, so results do not depend on it).
    """
    for name, v in (("context", context), ("stride", stride)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise ValueError(f"{name}={v!r}: must be an int")
    context, stride = int(context), int(stride)
    if context < 2:
        raise ValueError(f"context={context}: must be >= 2 (a window's first token has no prediction)")
    ids = token_ids(tokenizer, text_or_ids)
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, numbers.Integral) or max_tokens < 2:
            raise ValueError(f"max_tokens={max_tokens!r}: must be an int >= 2 or None")
        ids = ids[: int(max_tokens)]
    check_ids(model, ids)  # only what the model will read
    if ids.numel() < 2:
        raise ValueError(f"{ids.numel()} tokens: need at least 2 to score one")
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}: must be an int >= 1")
    batch_size = int(batch_size)
    if not 1 <= stride <= context:  # as asked; the clipping below may shorten both
        raise ValueError(f"stride={stride}: must be in [1, context={context}]")
    limit = model_context(model)
    if limit is not None and context > limit:
        context = int(limit)
    stride = min(stride, context)
    wins = windows(ids.numel(), context, stride)
    device = input_device(model)
    keep_arg = "logits_to_keep" in inspect.signature(model.forward).parameters

    # consecutive windows of the same shape form a batch
    groups: list[list[tuple[int, int, int]]] = []
    for w in wins:
        g = groups[-1] if groups else None
        if g and len(g) < batch_size and (g[0][1] - g[0][0], g[0][2]) == (w[1] - w[0], w[2]):
            g.append(w)
        else:
            groups.append([w])

    nll_sum, scored_total = 0.0, 0
    bar = tqdm(total=len(wins), desc="perplexity", unit="win", disable=not progress)
    for g in groups:
        length, scored = g[0][1] - g[0][0], g[0][2]
        x_BL = torch.stack([ids[b:e] for b, e, _ in g]).to(device)
        kwargs = {"use_cache": False}
        if keep_arg:
            kwargs["logits_to_keep"] = scored + 1  # logits at positions L-scored-1 .. L-1
        logits_BSV = model(input_ids=x_BL, **kwargs).logits
        logits_BSV = logits_BSV[:, -(scored + 1) : -1]  # predictions of the last `scored` tokens
        target_BS = x_BL[:, length - scored :].to(logits_BSV.device)
        # per-token losses in fp32, summed in fp64: an fp32 sum of a batch's ~10^4-10^5 losses rounds it by up to
        # about 1e-6 of the perplexity, more than the differences a routing change can make
        nll = F.cross_entropy(logits_BSV.float().reshape(-1, logits_BSV.shape[-1]), target_BS.reshape(-1),
                              reduction="none").double().sum()
        if not math.isfinite(nll := float(nll)):  # as the patched path's router check: at the first bad window
            bar.close()
            bad = (~torch.isfinite(logits_BSV)).nonzero()
            i = bad[0].tolist() if len(bad) else [0]
            at = f"logits[{i[0]}, {i[1]}, {i[2]}]={logits_BSV[tuple(i)].item()}" if len(bad) else f"nll={nll}"
            raise ValueError(f"{at} in the window ids[{g[i[0]][0]}:{g[i[0]][1]}]: logits must be finite "
                             "(NaN or inf in the model's weights or activations?)")
        nll_sum += nll
        scored_total += scored * len(g)
        bar.update(len(g))
    bar.close()
    nll_mean = nll_sum / scored_total
    lengths = [e - b for b, e, _ in wins]
    return {
        "ppl": math.exp(nll_mean),
        "nll": nll_mean,
        "scored_tokens": scored_total,
        "context": context,
        "stride": stride,
        "windows": len(wins),
        "forwarded_tokens": sum(lengths),
        "attended_mean": sum(n * (n + 1) / 2 for n in lengths) / sum(lengths),  # a token's mean attended length
        "longest_window": max(lengths),
    }
