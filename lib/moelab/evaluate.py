"""Perplexity of a model with its routing changed by a policy, and the compute that policy saves.

Measured (`evaluate`): sliding-window perplexity through `moelab.hf.patched`; mean k counts the kept pairs of every
forwarded position. Estimated (`router_sample`, `RouterSample.estimate`): any policy's k from router outputs
recorded once, unchanged; estimates ignore that later layers' inputs change (rows say estimated=True;
`confirm_estimates` checks a few against measurements). Reductions are against the native k (`moelab.compute`).

Windows: `context` tokens every `stride` tokens, each scoring only tokens no earlier window scored (never its
first); the context is clipped to the model's max_position_embeddings, the stride to the context.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from moelab.compute import ModelShapes, check_context, expert_reduction
from moelab.hf import RoutingRecord, moe_layers, native_policy, patched, record_router
from moelab.models import as_ids, check_ids, input_device, model_context
from moelab.params import check_int, is_real
from moelab.routing import EntropyAdaptiveK, Policy, RatioSkip, TopK, TopP, check_policy, choose_k, quantile

log = logging.getLogger(__name__)
QUANTILES = (0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95)
SIXTEEN_BIT = ("bfloat16", "float16")  # weight dtypes in which the patch alone moves perplexity (`reference_ppl`)


# ---- token streams and perplexity ------------------------------------------------------------------------------

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
    if ids.numel() and (ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool):
        raise ValueError(f"token ids of dtype {ids.dtype}: must be integers")  # empty: torch.as_tensor([]) is float
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
        scored = min(end - prev_end, end - begin - 1)  # new tokens only, never the window's first
        if scored > 0:
            out.append((begin, end, scored))
        prev_end = end
        if end == n_tokens:
            break
    return out


def _takes_logits_to_keep(model) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def _prepare(model, tokenizer, text_or_ids, context, stride, max_tokens, batch_size):
    """Checked ids, windows and batches (consecutive windows of one shape), context and stride after clipping."""
    context = check_int("context", context, 2)
    stride = check_int("stride", stride, 1)
    batch_size = check_int("batch_size", batch_size, 1)
    ids = token_ids(tokenizer, text_or_ids)
    if max_tokens is not None:
        ids = ids[: check_int("max_tokens", max_tokens, 2, " or None")]
    check_ids(model, ids)  # only what the model will read
    if ids.numel() < 2:
        raise ValueError(f"{ids.numel()} tokens: need at least 2 to score one")
    if stride > context:  # as asked; the clipping below may shorten both
        raise ValueError(f"stride={stride}: must be in [1, context={context}]")
    context = min(context, model_context(model) or context)
    stride = min(stride, context)
    wins = windows(ids.numel(), context, stride)
    groups: list[list[tuple[int, int, int]]] = []
    for w in wins:
        g = groups[-1] if groups else None
        if g and len(g) < batch_size and (g[0][1] - g[0][0], g[0][2]) == (w[1] - w[0], w[2]):
            g.append(w)
        else:
            groups.append([w])
    return ids, wins, groups, context, stride


def _score(model, ids, groups, runs, kl: bool, progress: bool) -> list[dict]:
    """Each batch forwarded once per run (a context factory), in order: per run each window's NLL sum and, with kl,
    the KL divergence from run 0's next-token distribution and top-1 agreement with it."""
    device, keep = input_device(model), _takes_logits_to_keep(model)
    out = [{"window_nll": [], "kl": 0.0, "agree": 0} for _ in runs]
    bar = tqdm(total=sum(map(len, groups)) * len(runs), desc="perplexity", unit="win", disable=not progress)
    for g in groups:
        length, scored = g[0][1] - g[0][0], g[0][2]
        x_BL = torch.stack([ids[b:e] for b, e, _ in g]).to(device)
        kwargs = {"logits_to_keep": scored + 1} if keep else {}
        ref_BSV = None
        for j, run in enumerate(runs):
            with run():
                logits_BSV = model(input_ids=x_BL, use_cache=False, **kwargs).logits[:, -(scored + 1) : -1]
            logp_BSV = torch.log_softmax(logits_BSV.float(), dim=-1)
            target_BS = x_BL[:, length - scored :].to(logp_BSV.device)
            nll_B = -logp_BSV.gather(-1, target_BS[..., None])[..., 0].double().sum(1)
            if not torch.isfinite(nll_B).all():  # at the first bad window, as the patched path's router check
                bar.close()
                bad = (~torch.isfinite(logits_BSV)).nonzero()
                i = bad[0].tolist() if len(bad) else [int((~torch.isfinite(nll_B)).nonzero()[0]), 0, 0]
                at = f"logits[{i[0]}, {i[1]}, {i[2]}]={logits_BSV[tuple(i)].item()}" if len(bad) else "nll=nan"
                raise ValueError(f"{at} in the window ids[{g[i[0]][0]}:{g[i[0]][1]}]: logits must be finite "
                                 "(NaN or inf in the model's weights or activations?)")
            out[j]["window_nll"] += nll_B.tolist()
            if kl and j == 0:  # the reference: KL 0, every token agrees
                ref_BSV = logp_BSV
                out[j]["agree"] += target_BS.numel()
            elif kl:
                kl_BS = F.kl_div(logp_BSV, ref_BSV, reduction="none", log_target=True).sum(-1)
                out[j]["kl"] += float(kl_BS.double().sum())
                out[j]["agree"] += int((logp_BSV.argmax(-1) == ref_BSV.argmax(-1)).sum())
            bar.update(len(g))
    bar.close()
    return out


def _totals(res: dict, wins, context: int, stride: int, kl: bool) -> dict:
    tokens = [w[2] for w in wins]
    nll_sum, scored_total = math.fsum(res["window_nll"]), sum(tokens)
    lengths = [e - b for b, e, _ in wins]
    out = {"ppl": math.exp(nll_sum / scored_total), "nll": nll_sum / scored_total, "scored_tokens": scored_total,
           "context": context, "stride": stride, "windows": len(wins), "forwarded_tokens": sum(lengths),
           "attended_mean": sum(n * (n + 1) / 2 for n in lengths) / sum(lengths), "longest_window": max(lengths),
           "window_nll": res["window_nll"], "window_tokens": tokens}
    if kl:
        out.update(kl=res["kl"] / scored_total, top1_agree=res["agree"] / scored_total)
    return out


@torch.no_grad()
def perplexity(model, tokenizer, text_or_ids, context: int = 2048, stride: int = 512, max_tokens: int | None = None,
               batch_size: int = 1, progress: bool = True) -> dict:
    """Sliding-window perplexity of a causal LM on one token stream: dict(ppl, nll, scored_tokens, context, stride,
    windows, window_nll, window_tokens, forwarded_tokens, attended_mean, longest_window). Windows of one shape run
    batched (no padding); losses are summed in fp64 (an fp32 sum rounds by more than a routing change moves it)."""
    ids, wins, groups, context, stride = _prepare(model, tokenizer, text_or_ids, context, stride, max_tokens,
                                                  batch_size)
    (res,) = _score(model, ids, groups, [contextlib.nullcontext], kl=False, progress=progress)
    return _totals(res, wins, context, stride, kl=False)


# ---- paired bootstrap over windows ------------------------------------------------------------------------------

def bootstrap_ppl(window_nll, window_tokens, resamples: int = 2000, seed: int = 0) -> np.ndarray:
    """[resamples, rows] perplexities of rows (window_nll [rows, W] or [W], NLL sums per window) on windows drawn
    with replacement: the same draws for every row (paired), from a seeded generator."""
    nll_RW = np.atleast_2d(np.asarray(window_nll, dtype=np.float64))
    tok_W = np.asarray(window_tokens, dtype=np.float64)
    if nll_RW.shape[1] != tok_W.shape[0] or tok_W.ndim != 1 or tok_W.size < 2:
        raise ValueError(f"window_nll of shape {nll_RW.shape}, window_tokens of shape {tok_W.shape}: need one NLL "
                         "sum per window for each row, the same windows for all, at least 2")
    W = tok_W.size
    counts_BW = np.random.default_rng(check_int("seed", seed, 0)).multinomial(
        W, np.full(W, 1.0 / W), size=check_int("resamples", resamples, 1)).astype(np.float64)
    return np.exp((counts_BW @ nll_RW.T) / (counts_BW @ tok_W)[:, None])


def interval(ppl_a_B, ppl_b_B, a: float, b: float, level: float = 0.95) -> tuple[float, float, float]:
    """(a / b - 1, and its percentile interval at `level` from paired resampled perplexities)."""
    lo, hi = np.quantile(np.asarray(ppl_a_B) / np.asarray(ppl_b_B) - 1.0, [(1 - level) / 2, (1 + level) / 2])
    return a / b - 1.0, float(lo), float(hi)


def ppl_change_ci(nll_a, nll_b, window_tokens, resamples: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """A's perplexity change against B on the same windows with its paired bootstrap interval at `level`."""
    ppl_BR = bootstrap_ppl([nll_a, nll_b], window_tokens, resamples, seed)
    tok = float(np.sum(window_tokens))
    ppl_a, ppl_b = (math.exp(math.fsum(x) / tok) for x in (nll_a, nll_b))
    change, lo, hi = interval(ppl_BR[:, 0], ppl_BR[:, 1], ppl_a, ppl_b, level)
    return {"ppl_change": change, "ci_lo": lo, "ci_hi": hi, "windows": len(window_tokens), "resamples": resamples,
            "bootstrap_seed": seed}


# ---- labels and columns ----------------------------------------------------------------------------------------

def _fmt(xs) -> str:
    return "[" + ", ".join(f"{x:g}" for x in xs) + "]"


def policy_params(policy) -> dict:
    """A label ('TopK k=2', 'EntropyAdaptiveK k=[1, 2, 4] th=[0.6, 1.2]', 'native', 'per-layer ...') and flat
    columns (kind, k range, its own parameter) describing a policy."""
    if policy is None:
        return {"label": "native", "policy": "native"}
    if isinstance(policy, (list, tuple, dict)):
        vals = list(policy.values()) if isinstance(policy, dict) else list(policy)
        kinds = sorted({type(p).__name__ for p in vals})
        out = {"label": f"per-layer {'/'.join(kinds)}", "policy": kinds[0] if len(kinds) == 1 else "mixed",
               "per_layer": True}
        if all(isinstance(p, EntropyAdaptiveK) for p in vals):
            out["k_values"] = str(list(vals[0].k_values))
            out["thresholds"] = str([[round(t, 4) for t in p.thresholds] for p in vals])
        return out
    if not isinstance(policy, (TopK, EntropyAdaptiveK, TopP, RatioSkip)):
        raise ValueError(f"policy {policy!r}: not a moelab policy")
    out = {"label": "", "policy": type(policy).__name__, "k_min": policy.k_min, "k_max": policy.k_max}
    k_range = f"k=[{policy.k_min},{policy.k_max}]"
    if isinstance(policy, TopK):
        out["label"] = f"TopK k={policy.k}"
    elif isinstance(policy, EntropyAdaptiveK):
        th = [round(t, 4) for t in policy.thresholds]
        out.update(label=f"EntropyAdaptiveK k={_fmt(policy.k_values)} th={_fmt(th)}",
                   k_values=str(list(policy.k_values)), thresholds=str(th))
    elif isinstance(policy, TopP):
        out.update(label=f"TopP p={policy.p:.4g} {k_range}", p=float(policy.p))
    else:
        out.update(label=f"RatioSkip beta={policy.beta:.4g} {k_range}", beta=float(policy.beta))
    return out


def policy_label(policy) -> str:
    return policy_params(policy)["label"]


def model_dtype(model) -> str:
    """The dtype of the model's weights by name ('float32', 'bfloat16', ...), for results and titles."""
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def entropy_quantiles(entropy_T: torch.Tensor, qs=QUANTILES) -> dict:
    """{'ent_q05': ..., ...}: quantiles in nats of per-token router entropy."""
    v = quantile(entropy_T.float(), torch.tensor(qs, dtype=torch.float32)).tolist()
    return {f"ent_q{int(round(q * 100)):02d}": float(x) for q, x in zip(qs, v)}


def _shapes(model) -> ModelShapes:
    return ModelShapes.from_config(model.config.get_text_config() if hasattr(model.config, "get_text_config")
                                   else model.config)


def _compute_cols(shapes: ModelShapes, mean_k_layers: list[float], attended: float, prefill: int) -> dict:
    """Mean k and the reductions (the whole forward's at the mean attended length, `prefill` tokens a window)."""
    mean_k = float(np.mean(mean_k_layers))
    return {"native_k": shapes.native_k, "mean_k": mean_k,
            "expert_reduction": expert_reduction(mean_k, shapes.native_k),
            "forward_reduction": shapes.forward_reduction(list(mean_k_layers), int(round(attended)), prefill=prefill)}


# ---- measured --------------------------------------------------------------------------------------------------

@dataclass
class Evaluation:
    """A summary row, per-layer statistics, per-layer k histograms, each window's NLL sum and scored tokens."""

    summary: dict
    layers: pd.DataFrame
    k_hist: pd.DataFrame
    window_nll: list[float] | None = None
    window_tokens: list[int] | None = None


def _warn_unchanged(policies: dict[int, Policy], layers, k_by_layer: dict, rec) -> None:
    """Warn where adaptive policies kept k_max for every token of every layer they routed (e.g. flat routers)."""
    ran = [(layers[i], p) for i, p in policies.items() if p.k_min < p.k_max and i in k_by_layer]
    if not ran or any(bool((k_by_layer[layer.index] != p.k_max).any()) for layer, p in ran):
        return
    ent_T = torch.cat([rec.entropy(layer.index) for layer, _ in ran])
    if ent_T.numel() == 0:
        return
    med = float(ent_T.median())
    pct = 100 * med / math.log(max(layer.num_experts for layer, _ in ran))
    flat = "; the routers look flat, as an untrained model's do" if pct >= 95 else ""
    labels = " / ".join(sorted({policy_label(p) for _, p in ran}))
    log.warning("%s kept k_max for every token in the %d layer(s) it routed, so it changed nothing (median router "
                "entropy %.3f nats, %.0f%% of log E%s)", labels, len(ran), med, pct, flat)


def _recording(model, policy, into: RoutingRecord, state: dict):
    """A context factory: forwards unchanged (policy None) or patched, their k and entropy added to `into`."""
    @contextlib.contextmanager
    def run():
        with record_router(model, logits=False) if policy is None else patched(model, policy, record=True) as live:
            yield
        rec = live if policy is None else live.record
        state["policies"] = {} if policy is None else live.policies
        for name in ("k_chunks", "entropy_chunks"):
            for i, chunks in getattr(rec, name).items():
                getattr(into, name).setdefault(i, []).extend(chunks)
    return run


@torch.no_grad()
def evaluate(model, policy, text_or_ids, tokenizer=None, context: int = 2048, stride: int = 512,
             max_tokens: int | None = None, batch_size: int = 8, baseline_ppl: float | None = None,
             progress: bool = True, warn_unchanged: bool = True, kl: bool = False) -> Evaluation:
    """Perplexity with routing changed by `policy` (None: unchanged; a list or dict as `moelab.hf.patched` takes)
    and its compute. baseline_ppl adds ppl_change (in 16-bit, compare against `reference_ppl`); kl adds the KL
    divergence from the unchanged model and top-1 agreement; warn_unchanged logs an adaptive policy that changed
    nothing."""
    return evaluate_many(model, [policy], text_or_ids, tokenizer, context, stride, max_tokens, batch_size,
                         baseline_ppl, progress, warn_unchanged, kl)[0]


@torch.no_grad()
def evaluate_many(model, policies, text_or_ids, tokenizer=None, context: int = 2048, stride: int = 512,
                  max_tokens: int | None = None, batch_size: int = 8, baseline_ppl: float | None = None,
                  progress: bool = True, warn_unchanged: bool = True, kl: bool = True) -> list[Evaluation]:
    """`evaluate` for several policies in one pass over the same windows (paired): each batch forwarded once per
    policy, with kl once unchanged first."""
    if baseline_ppl is not None and not (is_real(baseline_ppl) and math.isfinite(baseline_ppl) and baseline_ppl > 0):
        raise ValueError(f"baseline_ppl={baseline_ppl!r}: must be a finite perplexity > 0 (or None)")
    policies = list(policies)
    if not policies:
        raise ValueError("policies=[]: nothing to evaluate")
    layers = moe_layers(model)
    shapes = _shapes(model)
    if shapes.moe_layers != len(layers):
        raise ValueError(f"config says {shapes.moe_layers} MoE layers but the model has {len(layers)} MoE blocks")
    for p in policies:  # each policy checked (by patching and restoring the model) before the first forward
        if p is not None:
            with patched(model, p):
                pass
    ids, wins, groups, context, stride = _prepare(model, tokenizer, text_or_ids, context, stride, max_tokens,
                                                  batch_size)
    runs = [None, *(p for p in policies if p is not None)] if kl else policies  # kl: the unchanged run first
    at = iter(range(1, len(runs))) if kl else iter(range(len(runs)))
    which = [0 if kl and p is None else next(at) for p in policies]  # each policy's run
    recs, states = [RoutingRecord() for _ in runs], [{} for _ in runs]
    res = _score(model, ids, groups, [_recording(model, p, r, st) for p, r, st in zip(runs, recs, states)], kl,
                 progress)
    out = []
    for policy, r in zip(policies, which):
        tot, rec = _totals(res[r], wins, context, stride, kl), recs[r]
        k_by_layer = {i: rec.k(i) for i in range(len(layers)) if i in rec.k_chunks}
        if policy is not None and warn_unchanged:
            _warn_unchanged(states[r]["policies"], layers, k_by_layer, rec)
        mean_k_layers, layer_rows, hist_rows = [], [], []
        k_max = max((int(k.max()) for k in k_by_layer.values() if k.numel()), default=0)
        for layer in layers:
            i = layer.index
            if i not in k_by_layer:  # a layer a per-layer dict left unpatched: native routing, not recorded
                mean_k_layers.append(float(layer.native_k))
                continue
            k_T = k_by_layer[i]
            mk = float(k_T.float().mean())
            mean_k_layers.append(mk)
            layer_rows.append({"layer": i, "tokens": int(k_T.numel()), "mean_k": mk,
                               "expert_reduction": expert_reduction(mk, layer.native_k),
                               **entropy_quantiles(rec.entropy(i))})
            n = max(int(k_T.numel()), 1)
            hist_rows += [{"layer": i, "k": k, "tokens": c, "fraction": c / n}
                          for k, c in enumerate(torch.bincount(k_T.long(), minlength=k_max + 1).tolist())]
        summary = {
            **policy_params(policy), "estimated": False,
            "dtype": model_dtype(model),
            **{key: tot[key] for key in ("ppl", "nll", "scored_tokens", "context", "stride")},
            **({"kl": tot["kl"], "top1_agree": tot["top1_agree"]} if kl else {}),
            "routed_tokens": int(sum(r["tokens"] for r in layer_rows) / max(len(layer_rows), 1)),
            **_compute_cols(shapes, mean_k_layers, tot["attended_mean"], tot["longest_window"]),
        }
        if baseline_ppl is not None:
            summary["ppl_base"] = baseline_ppl
            summary["ppl_change"] = tot["ppl"] / baseline_ppl - 1.0
        out.append(Evaluation(summary, pd.DataFrame(layer_rows), pd.DataFrame(hist_rows), tot["window_nll"],
                              tot["window_tokens"]))
    return out


def reference_ppl(model, ids, progress: bool = False, **eval_kw) -> dict:
    """The perplexity a routing change is measured against: the unchanged model, or in 16-bit (where the patch
    alone moves perplexity) its native TopK through moelab; `reference` says which."""
    sixteen = model_dtype(model) in SIXTEEN_BIT
    pol = [native_policy(layer) for layer in moe_layers(model)] if sixteen else None
    summary = evaluate(model, pol, ids, progress=progress, **eval_kw).summary
    return {**summary, "reference": "patched-native" if sixteen else "unchanged"}


# ---- estimated -------------------------------------------------------------------------------------------------

@dataclass
class RouterSample:
    """Router outputs of unchanged forwards, per MoE layer: entropy [T] and the top-k_cap probs/ids."""

    entropy: list[torch.Tensor]  # [T] float32 nats
    top_probs: list[torch.Tensor]  # [T, k_cap] float32, descending (ties: lower expert first)
    top_ids: list[torch.Tensor]  # [T, k_cap] int16 (int32 above 2^15 experts)
    num_experts: int
    native_k: int
    renormalize: bool
    shapes: ModelShapes
    context: int  # chunk length of the recording forwards
    unused_tokens: int = 0  # the text's tail after the last whole chunk: not recorded

    @property
    def num_tokens(self) -> int:
        return int(self.entropy[0].numel())

    @property
    def num_layers(self) -> int:
        return len(self.entropy)

    @property
    def k_cap(self) -> int:
        return int(self.top_probs[0].shape[1])

    def entropy_all(self) -> torch.Tensor:
        return torch.cat(self.entropy)

    def k(self, policy: Policy, layer: int) -> torch.Tensor:
        """k [T] the policy would choose in a layer, from the recorded router outputs."""
        if policy.k_max > self.k_cap:
            raise ValueError(f"k_max={policy.k_max} exceeds the sample's k_cap={self.k_cap}: "
                             "record with a larger k_cap")
        return choose_k(policy, self.top_probs[layer][:, : policy.k_max], self.entropy[layer]).to(torch.int32)

    def expert_load(self, policy: Policy | None = None) -> np.ndarray:
        """[layers, E] counts of kept (token, expert) pairs under a policy (None: native top-k)."""
        policy = policy or TopK(self.native_k)
        out = np.zeros((self.num_layers, self.num_experts), dtype=np.int64)
        for layer in range(self.num_layers):
            keep = torch.arange(policy.k_max)[None, :] < self.k(policy, layer)[:, None]
            ids = self.top_ids[layer][:, : policy.k_max][keep].long()
            out[layer] = torch.bincount(ids, minlength=self.num_experts).numpy()
        return out

    def estimate(self, policy, attended: float | None = None) -> dict:
        """Estimated mean k and reductions of a policy (or a list, one per layer); attended: a chunk's by default."""
        if isinstance(policy, dict):
            raise ValueError("estimate takes one policy or a list (one per layer), not a dict")
        pols = list(policy) if isinstance(policy, (list, tuple)) else [policy] * self.num_layers
        if len(pols) != self.num_layers:
            raise ValueError(f"{len(pols)} policies: need one per MoE layer ({self.num_layers})")
        for p in pols:
            check_policy(p)
        if attended is not None:
            check_context(attended, "attended")
        mean_k_layers = [float(self.k(p, i).float().mean()) for i, p in enumerate(pols)]
        attended = attended if attended is not None else (self.context + 1) / 2
        return {**policy_params(policy), "estimated": True,
                "sample_tokens": self.num_tokens, **_compute_cols(self.shapes, mean_k_layers, attended, self.context),
                "mean_k_layers": mean_k_layers}


@torch.no_grad()
def router_sample(model, text_or_ids, tokenizer=None, context: int = 2048, max_tokens: int | None = None,
                  batch_size: int = 8, k_cap: int | None = None, progress: bool = True) -> RouterSample:
    """Router outputs of unchanged forwards over disjoint chunks of `context` tokens (a shorter tail is left out:
    `unused_tokens`)."""
    context, batch_size = check_int("context", context), check_int("batch_size", batch_size)
    for name, v in (("max_tokens", max_tokens), ("k_cap", k_cap)):
        if v is not None:
            check_int(name, v, 1, " or None")
    ids = token_ids(tokenizer, text_or_ids)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    check_ids(model, ids)
    context = min(context, model_context(model) or context)
    n = ids.numel() // context
    if n < 1:  # a short text: one chunk of what there is
        context, n = ids.numel(), 1
    if context < 1:
        raise ValueError(f"{ids.numel()} tokens: nothing to record")
    layers = moe_layers(model)
    E, native_k = layers[0].num_experts, layers[0].native_k
    k_cap = k_cap if k_cap is not None else min(E, max(16, 2 * native_k))
    if not 1 <= k_cap <= E:
        raise ValueError(f"k_cap={k_cap}: must be in [1, num_experts={E}]")
    id_dtype = torch.int16 if E <= 2**15 else torch.int32  # expert ids up to E - 1
    x_NL = ids[: n * context].view(n, context)
    device = input_device(model)
    keep = {"logits_to_keep": 1} if _takes_logits_to_keep(model) else {}  # we need the routers, not the logits
    ent, probs, eids = ([[] for _ in layers] for _ in range(3))
    with record_router(model, logits=True) as rec:
        for b in tqdm(range(0, n, batch_size), desc="router sample", disable=not progress):
            model(input_ids=x_NL[b : b + batch_size].to(device), use_cache=False, **keep)
            for i in range(len(layers)):  # condensed right away: sorted top-k_cap probabilities and ids
                logits_TE = torch.cat(rec.logit_chunks.pop(i))
                rec.k_chunks.pop(i)
                ent[i].append(torch.cat(rec.entropy_chunks.pop(i)))
                p_sorted, i_sorted = torch.sort(torch.softmax(logits_TE.float(), dim=-1), dim=-1, descending=True,
                                                stable=True)
                probs[i].append(p_sorted[:, :k_cap].contiguous())
                eids[i].append(i_sorted[:, :k_cap].to(id_dtype))
    return RouterSample(entropy=[torch.cat(e) for e in ent], top_probs=[torch.cat(p) for p in probs],
                        top_ids=[torch.cat(e) for e in eids], num_experts=E, native_k=native_k,
                        renormalize=layers[0].renormalize, shapes=_shapes(model), context=context,
                        unused_tokens=ids.numel() - n * context)


def confirm_estimates(model, sample: RouterSample, policies, text_or_ids, tokenizer=None,
                      baseline_ppl: float | None = None, progress: bool = True, **eval_kw) -> pd.DataFrame:
    """Estimated and measured mean k side by side for a few policies; est_error_layers per MoE layer."""
    rows = []
    for p in tqdm(list(policies), desc="confirm", disable=not progress):
        est = sample.estimate(p)
        ev = evaluate(model, p, text_or_ids, tokenizer=tokenizer, baseline_ppl=baseline_ppl, progress=False,
                      **eval_kw)
        s = ev.summary
        rows.append({
            "label": est["label"], "policy": est["policy"], "est_mean_k": est["mean_k"],
            "est_expert_reduction": est["expert_reduction"], "mean_k": s["mean_k"],
            "expert_reduction": s["expert_reduction"], "forward_reduction": s["forward_reduction"], "ppl": s["ppl"],
            "ppl_change": s.get("ppl_change"), "est_error": est["expert_reduction"] - s["expert_reduction"],
            "est_error_layers": [expert_reduction(mk, sample.native_k) - r for mk, r in
                                 zip(est["mean_k_layers"], ev.layers.sort_values("layer")["expert_reduction"])],
        })
    return pd.DataFrame(rows)
