"""Evaluate a routing policy on a model and a text: perplexity with the routing changed, and compute.

Two kinds of numbers, never mixed up:
- measured (`evaluate`): a sliding-window perplexity whose forwards run through `moelab.hf.patched`,
  so the routing really changed and the experts really skipped work; mean k is counted from the
  kept pairs of those forwards (every forwarded position, context included: the work that was done);
- estimated (`router_sample` + `estimate`): router outputs recorded once from unchanged forwards,
  then any policy's k computed from them without another forward. Estimates ignore that later layers'
  inputs change once earlier layers route differently; rows carry `estimated=True`, and
  `confirm_estimates` puts a few of them beside real patched measurements.
Compute reductions are counted against the model's native k: routed-expert FLOPs and whole-forward
FLOPs (moelab.compute.ModelShapes, attention at the average attended length of a window, linear-attention
layers in their chunked prefill form over a window).
"""

from __future__ import annotations

import logging
import math
import numbers
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from moelab.compute import ModelShapes, check_context, expert_reduction
from moelab.hf import moe_layers, patched, record_router
from moelab.models import check_ids, input_device, model_context
from moelab.perplexity import perplexity, token_ids
from moelab.routing import EntropyAdaptiveK, Policy, RatioSkip, TopK, TopP, check_policy, quantile

__all__ = [
    "Evaluation",
    "RouterSample",
    "evaluate",
    "router_sample",
    "estimate",
    "estimate_grid",
    "confirm_estimates",
    "policy_label",
    "policy_params",
    "model_dtype",
    "SIXTEEN_BIT",
    "k_hist_frame",
    "entropy_quantiles",
    "QUANTILES",
]

log = logging.getLogger(__name__)
QUANTILES = (0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95)


def _fmt(xs) -> str:
    return "[" + ", ".join(f"{x:g}" for x in xs) + "]"


def policy_label(policy) -> str:
    """A short human label: 'TopK k=2', 'EntropyAdaptiveK k=[1, 2, 4] th=[0.6, 1.2]', 'native', 'per-layer ...'."""
    if policy is None:
        return "native"
    if isinstance(policy, (list, tuple, dict)):
        vals = list(policy.values()) if isinstance(policy, dict) else list(policy)
        kinds = sorted({type(p).__name__ for p in vals})
        return f"per-layer {'/'.join(kinds)}"
    if isinstance(policy, TopK):
        return f"TopK k={policy.k}"
    if isinstance(policy, EntropyAdaptiveK):
        return f"EntropyAdaptiveK k={_fmt(policy.k_values)} th={_fmt(round(t, 4) for t in policy.thresholds)}"
    if isinstance(policy, TopP):
        return f"TopP p={policy.p:.4g} k=[{policy.k_min},{policy.k_max}]"
    if isinstance(policy, RatioSkip):
        return f"RatioSkip beta={policy.beta:.4g} k=[{policy.k_min},{policy.k_max}]"
    raise ValueError(f"policy {policy!r}: not a moelab policy")


def policy_params(policy) -> dict:
    """Flat columns describing a policy (kind, k range and its own parameter), for tidy frames."""
    if policy is None:
        return {"policy": "native"}
    if isinstance(policy, (list, tuple, dict)):
        vals = list(policy.values()) if isinstance(policy, dict) else list(policy)
        kinds = {type(p).__name__ for p in vals}
        out = {"policy": kinds.pop() if len(kinds) == 1 else "mixed", "per_layer": True}
        if all(isinstance(p, EntropyAdaptiveK) for p in vals):
            out["k_values"] = str(list(vals[0].k_values))
            out["thresholds"] = str([[round(t, 4) for t in p.thresholds] for p in vals])
        return out
    out = {"policy": type(policy).__name__, "k_min": policy.k_min, "k_max": policy.k_max}
    if isinstance(policy, EntropyAdaptiveK):
        out["k_values"] = str(list(policy.k_values))
        out["thresholds"] = str([round(t, 4) for t in policy.thresholds])
    elif isinstance(policy, TopP):
        out["p"] = float(policy.p)
    elif isinstance(policy, RatioSkip):
        out["beta"] = float(policy.beta)
    return out


SIXTEEN_BIT = ("bfloat16", "float16")  # model dtypes in which the patch alone moves perplexity (see `evaluate`)


def model_dtype(model) -> str:
    """The dtype of the model's weights by name ('float32', 'bfloat16', ...), for results and titles."""
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def _shapes(model) -> ModelShapes:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return ModelShapes.from_config(cfg)


def _compute_cols(shapes: ModelShapes, mean_k_layers: list[float], attended: float, prefill: int) -> dict:
    """Mean k and the reductions; the whole forward's at attention's average attended length and, for
    linear-attention layers, their chunked form over a prefill of `prefill` tokens (one window)."""
    mean_k = float(np.mean(mean_k_layers))
    return {
        "native_k": shapes.native_k,
        "mean_k": mean_k,
        "expert_reduction": expert_reduction(mean_k, shapes.native_k),
        "forward_reduction": shapes.forward_reduction(list(mean_k_layers), int(round(attended)), prefill=prefill),
        "compute_frac": 1.0 - expert_reduction(mean_k, shapes.native_k),  # routed-expert work kept
    }


def entropy_quantiles(entropy_T: torch.Tensor, qs=QUANTILES) -> dict:
    """{'ent_q05': ..., ...} quantiles in nats of per-token router entropy."""
    v = quantile(entropy_T.float(), torch.tensor(qs, dtype=torch.float32)).tolist()
    return {f"ent_q{int(round(q * 100)):02d}": float(x) for q, x in zip(qs, v)}


def k_hist_frame(k_by_layer: dict[int, torch.Tensor], k_max: int | None = None) -> pd.DataFrame:
    """Long frame (layer, k, tokens, fraction) of per-layer k histograms."""
    rows = []
    for layer, k_T in sorted(k_by_layer.items()):
        hist = torch.bincount(k_T.long(), minlength=(k_max or 0) + 1).tolist()
        n = max(int(k_T.numel()), 1)
        rows += [{"layer": layer, "k": k, "tokens": c, "fraction": c / n} for k, c in enumerate(hist)]
    return pd.DataFrame(rows)


@dataclass
class Evaluation:
    """One measured evaluation: a summary row, per-layer statistics and per-layer k histograms."""

    summary: dict
    layers: pd.DataFrame
    k_hist: pd.DataFrame

    def row(self, **extra) -> dict:
        return {**self.summary, **extra}


def _warn_unchanged(policies: dict[int, Policy], layers, k_by_layer: dict, rec) -> None:
    """Warn where adaptive policies (k_min < k_max) kept k_max for every token of every layer they routed: the
    rule changed nothing. Flat routers do that (an untrained model's entropy sits near log E, above the thresholds)."""
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


@torch.no_grad()
def evaluate(
    model,
    policy,
    text_or_ids,
    tokenizer=None,
    context: int = 2048,
    stride: int = 512,
    max_tokens: int | None = None,
    batch_size: int = 8,
    baseline_ppl: float | None = None,
    progress: bool = True,
    warn_unchanged: bool = True,
) -> Evaluation:
    """Perplexity with routing changed by `policy` (None: the model unchanged) and its compute.

    policy: one policy, a list (one per MoE layer) or a dict {moe layer: policy} (see moelab.hf.patched).
    baseline_ppl: if given, the summary also has ppl_change (relative, e.g. 0.004 = +0.4%). In bf16 the patch
    alone moves it by up to about 3e-4 on the embedded models over 16,384 tokens on the H200 and the CPU (router
    ties, and the experts' sum in fp32 where the unpatched block sums in bf16; `benchmarks/patch_noise.py`), more on
    short texts (1.7e-3 on tiny-mixtral's first 512 tokens on the CPU), in fp32 by under 1e-5: compare small
    changes in fp32, or against the patched native TopK in the same dtype (`moelab.calibrate.reference_ppl`). The
    summary's dtype says which.
    warn_unchanged: False where an adaptive policy that keeps k_max for every token is the intent (a budget
    search's zero-reduction bracket); otherwise that is logged as a warning.
    """
    if baseline_ppl is not None and (isinstance(baseline_ppl, bool) or not isinstance(baseline_ppl, numbers.Real)
                                     or not math.isfinite(baseline_ppl) or baseline_ppl <= 0):
        raise ValueError(f"baseline_ppl={baseline_ppl!r}: must be a finite perplexity > 0 (or None)")
    ids = token_ids(tokenizer, text_or_ids)
    layers = moe_layers(model)
    shapes = _shapes(model)
    if shapes.moe_layers != len(layers):
        raise ValueError(f"config says {shapes.moe_layers} MoE layers but the model has {len(layers)} MoE blocks")
    if policy is None:
        ctx = record_router(model, logits=False)
    else:
        ctx = patched(model, policy, record=True)
    with ctx as live:
        res = perplexity(model, None, ids, context=context, stride=stride, max_tokens=max_tokens,
                         batch_size=batch_size, progress=progress)
    rec = live if policy is None else live.record
    k_by_layer = {i: rec.k(i) for i in range(len(layers)) if i in rec.k_chunks}
    if policy is not None and warn_unchanged:
        _warn_unchanged(live.policies, layers, k_by_layer, rec)
    mean_k_layers = []
    layer_rows = []
    for layer in layers:
        i = layer.index
        if i in k_by_layer:
            k_T, ent_T = k_by_layer[i], rec.entropy(i)
            mk = float(k_T.float().mean())
            layer_rows.append({"layer": i, "tokens": int(k_T.numel()), "mean_k": mk,
                               "expert_reduction": expert_reduction(mk, layer.native_k), **entropy_quantiles(ent_T)})
        else:  # a layer a per-layer dict left unpatched: native routing, not recorded
            mk = float(layer.native_k)
        mean_k_layers.append(mk)
    attended = res["attended_mean"]  # over the windows run: a text shorter than the context is one short window
    summary = {
        "label": policy_label(policy),
        **policy_params(policy),
        "estimated": False,
        "dtype": model_dtype(model),  # the weights' dtype: bf16 / fp16 perplexities differ from fp32 ones
        "ppl": res["ppl"],
        "nll": res["nll"],
        "scored_tokens": res["scored_tokens"],
        "context": res["context"],
        "stride": res["stride"],
        "routed_tokens": int(sum(r["tokens"] for r in layer_rows) / max(len(layer_rows), 1)),
        **_compute_cols(shapes, mean_k_layers, attended, res["longest_window"]),
    }
    if baseline_ppl is not None:
        summary["ppl_base"] = baseline_ppl
        summary["ppl_change"] = res["ppl"] / baseline_ppl - 1.0
    k_max = max(int(k.max()) for k in k_by_layer.values()) if k_by_layer else None
    return Evaluation(summary, pd.DataFrame(layer_rows), k_hist_frame(k_by_layer, k_max))


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
            raise ValueError(
                f"k_max={policy.k_max} exceeds the sample's k_cap={self.k_cap}: record with a larger k_cap"
            )
        return policy.choose_k(self.top_probs[layer][:, : policy.k_max], self.entropy[layer]).to(torch.int32)

    def expert_load(self, policy: Policy | None = None) -> np.ndarray:
        """[layers, E] counts of kept (token, expert) pairs under a policy (None: native top-k)."""
        policy = policy or TopK(self.native_k)
        out = np.zeros((self.num_layers, self.num_experts), dtype=np.int64)
        for layer in range(self.num_layers):
            k_T = self.k(policy, layer)
            keep = torch.arange(policy.k_max)[None, :] < k_T[:, None]
            ids = self.top_ids[layer][:, : policy.k_max][keep].long()
            out[layer] = torch.bincount(ids, minlength=self.num_experts).numpy()
        return out


@torch.no_grad()
def router_sample(
    model,
    text_or_ids,
    tokenizer=None,
    context: int = 2048,
    max_tokens: int | None = None,
    batch_size: int = 8,
    k_cap: int | None = None,
    progress: bool = True,
) -> RouterSample:
    """Record router outputs once: unchanged forwards over disjoint chunks of `context` tokens (clipped to the
    model's context). A tail shorter than one chunk is not recorded: `unused_tokens` says how much."""
    for name, v in (("context", context), ("max_tokens", max_tokens), ("batch_size", batch_size), ("k_cap", k_cap)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name}={v!r}: must be an int >= 1" + ("" if name == "context" else " or None"))
    if context is None or batch_size is None:
        raise ValueError(f"context={context!r}, batch_size={batch_size!r}: must be ints >= 1")
    ids = token_ids(tokenizer, text_or_ids)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    check_ids(model, ids)
    limit = model_context(model)
    context = min(context, limit) if limit else context
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
    ent = [[] for _ in layers]
    probs = [[] for _ in layers]
    eids = [[] for _ in layers]
    with record_router(model, logits=True) as rec:
        for b in tqdm(range(0, n, batch_size), desc="router sample", disable=not progress):
            model(input_ids=x_NL[b : b + batch_size].to(device), use_cache=False, **_keep_one(model))
            # condense each layer's logits right away: sorted top-k_cap probabilities and ids
            for i in range(len(layers)):
                logits_TE = torch.cat(rec.logit_chunks.pop(i))
                rec.k_chunks.pop(i)
                ent[i].append(torch.cat(rec.entropy_chunks.pop(i)))
                p_TE = torch.softmax(logits_TE.float(), dim=-1)
                p_sorted, i_sorted = torch.sort(p_TE, dim=-1, descending=True, stable=True)
                probs[i].append(p_sorted[:, :k_cap].contiguous())
                eids[i].append(i_sorted[:, :k_cap].to(id_dtype))
    return RouterSample(
        entropy=[torch.cat(e) for e in ent],
        top_probs=[torch.cat(p) for p in probs],
        top_ids=[torch.cat(e) for e in eids],
        num_experts=E,
        native_k=native_k,
        renormalize=layers[0].renormalize,
        shapes=_shapes(model),
        context=context,
        unused_tokens=ids.numel() - n * context,
    )


def _keep_one(model) -> dict:
    """Ask for the last position's logits only where the model supports it (we need the routers)."""
    import inspect

    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


def _as_layer_list(policy, n: int) -> list[Policy]:
    if isinstance(policy, (list, tuple)):
        if len(policy) != n:
            raise ValueError(f"{len(policy)} policies: need one per MoE layer ({n})")
        for p in policy:
            check_policy(p)
        return list(policy)
    if isinstance(policy, dict):
        raise ValueError("estimate takes one policy or a list (one per layer), not a dict")
    check_policy(policy)
    return [policy] * n


def estimate(sample: RouterSample, policy, attended: float | None = None) -> dict:
    """Estimated mean k and compute reduction of a policy from a router sample (no forward pass)."""
    pols = _as_layer_list(policy, sample.num_layers)
    if attended is not None:
        check_context(attended, "attended")
    mean_k_layers = [float(sample.k(p, i).float().mean()) for i, p in enumerate(pols)]
    attended = attended if attended is not None else (sample.context + 1) / 2
    return {
        "label": policy_label(policy),
        **policy_params(policy),
        "estimated": True,
        "sample_tokens": sample.num_tokens,
        **_compute_cols(sample.shapes, mean_k_layers, attended, sample.context),
        "mean_k_layers": mean_k_layers,
    }


def estimate_grid(sample: RouterSample, policies, attended: float | None = None) -> pd.DataFrame:
    """One estimated row per policy (an iterable of policies or per-layer lists)."""
    return pd.DataFrame([estimate(sample, p, attended) for p in policies])


def confirm_estimates(
    model, sample: RouterSample, policies, text_or_ids, tokenizer=None, baseline_ppl: float | None = None,
    progress: bool = True, **eval_kw
) -> pd.DataFrame:
    """Estimated and measured (patched forwards) mean k side by side for a few policies; per MoE layer too
    (`est_error_layers`: estimated minus measured routed-expert reduction, first MoE layer first)."""
    rows = []
    for p in tqdm(list(policies), desc="confirm", disable=not progress):
        est = estimate(sample, p)
        ev = evaluate(model, p, text_or_ids, tokenizer=tokenizer, baseline_ppl=baseline_ppl, progress=False,
                      **eval_kw)
        rows.append({
            "label": est["label"],
            "policy": est["policy"],
            "est_mean_k": est["mean_k"],
            "est_expert_reduction": est["expert_reduction"],
            "mean_k": ev.summary["mean_k"],
            "expert_reduction": ev.summary["expert_reduction"],
            "forward_reduction": ev.summary["forward_reduction"],
            "ppl": ev.summary["ppl"],
            "ppl_change": ev.summary.get("ppl_change"),
            "est_error": est["expert_reduction"] - ev.summary["expert_reduction"],
            "est_error_layers": [expert_reduction(mk, sample.native_k) - r for mk, r in
                                 zip(est["mean_k_layers"], ev.layers.sort_values("layer")["expert_reduction"])],
        })
    return pd.DataFrame(rows)
