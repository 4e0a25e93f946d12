"""Patch the MoE blocks of a transformers 5 model so that they route and compute through moelab.

`patched(model, policy)` replaces, per instance, the `forward` of every MoE block's router (`.gate`, through
`moelab.routing.route`) and fused experts (`.experts`, only the kept pairs through `moelab.experts.run_experts`);
the block's own forward does the rest (shared experts). No parameter or module is touched, so leaving the context
restores the model exactly; accelerate's hooks still run (device_map models). `SUPPORTED_BLOCKS` lists the blocks
(softmax top-k router, concatenated gate/up experts without bias); `UNSUPPORTED_BLOCKS` are refused with the reason.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from moelab.experts import run_experts
from moelab.models import ALWAYS_RENORMALIZE, check_ids, input_device, model_context
from moelab.params import check_int, is_int
from moelab.routing import LOGIT_DTYPES, EntropyAdaptiveK, Policy, RatioSkip, TopK, TopP, route

# block class name -> family
SUPPORTED_BLOCKS = {
    "MixtralSparseMoeBlock": "mixtral",
    "MiniMaxSparseMoeBlock": "minimax",
    "Qwen2MoeSparseMoeBlock": "qwen2_moe",
    "Qwen3MoeSparseMoeBlock": "qwen3_moe",
    "Qwen3NextSparseMoeBlock": "qwen3_next",
    "Qwen3_5MoeSparseMoeBlock": "qwen3_5_moe",
    "Qwen3VLMoeTextSparseMoeBlock": "qwen3_vl_moe",
    "OlmoeSparseMoeBlock": "olmoe",
    "FlexOlmoSparseMoeBlock": "flex_olmo",
}
UNSUPPORTED_BLOCKS = {
    "DeepseekV3MoE": "sigmoid router with group-limited choice and score correction",
    "Ernie4_5_MoeSparseMoeBlock": "experts chosen on bias-corrected scores (moe_statics)",
    "GptOssMLP": "interleaved, transposed experts with biases and a clamped activation",
}
_POLICIES = (TopK, EntropyAdaptiveK, TopP, RatioSkip)


@dataclass
class MoELayer:
    """One MoE block of a model: its ordinal among MoE blocks, module path and routing convention."""

    index: int
    name: str
    block: torch.nn.Module
    family: str
    num_experts: int
    native_k: int
    renormalize: bool  # the model's convention: renormalise the kept weights to sum 1


def moe_layers(model) -> list[MoELayer]:
    """Every supported MoE block of a transformers model, in forward order; ValueError if none."""
    out = []
    for name, mod in model.named_modules():
        cls = type(mod).__name__
        if cls in UNSUPPORTED_BLOCKS:
            raise ValueError(f"{name} is a {cls}: not supported by moelab.hf ({UNSUPPORTED_BLOCKS[cls]})")
        if cls not in SUPPORTED_BLOCKS:
            continue
        gate, experts = mod.gate, mod.experts
        for attr, want in (("has_bias", False), ("is_transposed", False), ("is_concatenated", True),
                           ("has_gate", True)):
            if getattr(experts, attr, want) != want:
                raise ValueError(f"{name}.experts.{attr}={getattr(experts, attr)}: moelab.experts needs {want}")
        family = SUPPORTED_BLOCKS[cls]
        renorm = family in ALWAYS_RENORMALIZE or bool(gate.norm_topk_prob)
        out.append(MoELayer(len(out), name, mod, family, int(gate.num_experts), int(gate.top_k), renorm))
    if not out:
        raise ValueError(f"{type(model).__name__}: no supported MoE block (supported: {sorted(SUPPORTED_BLOCKS)})")
    return out


def native_policy(layer: MoELayer) -> TopK:
    """The model's own rule for a layer: top native_k with its renormalisation convention."""
    return TopK(layer.native_k, renormalize=layer.renormalize)


@dataclass
class RoutingRecord:
    """Per-layer chunks recorded during forwards: k [T] and entropy [T] always, logits [T, E] on request."""

    logits: bool = False
    k_chunks: dict = field(default_factory=dict)
    entropy_chunks: dict = field(default_factory=dict)
    logit_chunks: dict = field(default_factory=dict)

    def add(self, layer: int, k_T, entropy_T, logits_TE=None) -> None:
        self.k_chunks.setdefault(layer, []).append(k_T.detach().to("cpu", torch.int32))
        self.entropy_chunks.setdefault(layer, []).append(entropy_T.detach().to("cpu", torch.float32))
        if self.logits and logits_TE is not None:
            self.logit_chunks.setdefault(layer, []).append(logits_TE.detach().to("cpu", torch.float32))

    @property
    def layers(self) -> list[int]:
        return sorted(self.entropy_chunks)

    def _cat(self, chunks: dict, layer: int) -> torch.Tensor:
        if layer not in chunks:
            raise ValueError(f"layer={layer}: nothing recorded for it; recorded layers {sorted(chunks)}")
        return torch.cat(chunks[layer])

    def k(self, layer: int) -> torch.Tensor:
        return self._cat(self.k_chunks, layer)

    def entropy(self, layer: int) -> torch.Tensor:
        return self._cat(self.entropy_chunks, layer)

    def router_logits(self, layer: int) -> torch.Tensor:
        if not self.logits:
            raise ValueError("router logits were not recorded: use record='logits'")
        return self._cat(self.logit_chunks, layer)


class Patch:
    """Live state of a `patched` context: layers, policies, kept-pair counters and the record."""

    def __init__(self, layers: list[MoELayer], policies: dict[int, Policy], record: RoutingRecord | None):
        self.layers = layers
        self.policies = policies
        self.record = record
        self.kept_pairs = {i: 0 for i in policies}  # (token, expert) pairs the experts computed
        self.tokens = {i: 0 for i in policies}
        self.uncounted = 0  # layer forwards captured in CUDA graphs (trial captures included): never counted
        self._pending: dict[int, object] = {}

    def mean_k(self) -> dict[int, float]:
        """Mean kept experts per token of each patched layer over all forwards so far."""
        return {i: (int(self.kept_pairs[i]) / self.tokens[i] if self.tokens[i] else float("nan")) for i in self.tokens}

    def reset_counts(self) -> None:
        self.kept_pairs = {i: 0 for i in self.policies}
        self.tokens = {i: 0 for i in self.policies}
        self.uncounted = 0


def _resolve_policies(layers: list[MoELayer], policy_or_policies) -> dict[int, Policy]:
    n = len(layers)
    p = policy_or_policies
    if isinstance(p, _POLICIES):
        out = {i: p for i in range(n)}
    elif isinstance(p, (list, tuple)):
        if len(p) != n:
            raise ValueError(f"{len(p)} policies given: need one per MoE layer ({n}) or a single policy")
        out = dict(enumerate(p))
    elif isinstance(p, dict):
        if not p:
            raise ValueError("policy={}: a dict needs at least one {moe layer: policy} (None runs the model unchanged)")
        bad = [i for i in p if not (is_int(i) and 0 <= i < n)]
        if bad:
            raise ValueError(f"policy keys {bad}: must be MoE layer ordinals (ints, not bools) in [0, {n})")
        out = {int(i): pol for i, pol in p.items()}  # layers left out keep the model's own routing
    else:
        raise ValueError(f"policy {p!r}: must be a moelab policy, a list of them (one per layer) or a dict")
    for i, pol in out.items():
        if not isinstance(pol, _POLICIES):
            raise ValueError(f"policy for layer {i} is {pol!r}: must be one of {[c.__name__ for c in _POLICIES]}")
        if pol.k_max > layers[i].num_experts:
            raise ValueError(f"layer {i}: k_max={pol.k_max} exceeds its num_experts={layers[i].num_experts}")
    return out


def _gate_forward(patch: Patch, layer: MoELayer, policy: Policy, check: bool):
    gate = layer.block.gate

    def forward(hidden_states):
        # a captured count would add into the counter tensor at every replay, even after it is freed: not counted
        capturing = hidden_states.is_cuda and torch.cuda.is_current_stream_capturing()
        if capturing and patch.record is not None:
            raise RuntimeError(f"{layer.name}: a patched(record={'logits' if patch.record.logits else True!r}) "
                               "forward cannot be captured in a CUDA graph (the record copies each forward to "
                               "the host); record in eager forwards, or capture with record=False")
        h_TD = hidden_states.reshape(-1, gate.weight.shape[1])
        logits_TE = F.linear(h_TD, gate.weight)
        plan = route(logits_TE, policy, renormalize=layer.renormalize, num_experts=layer.num_experts, check=check)
        if layer.index in patch._pending:
            raise RuntimeError(f"{layer.name}: a routing plan was made but its experts never ran")
        patch._pending[layer.index] = plan
        if capturing:
            patch.uncounted += 1
        else:
            patch.kept_pairs[layer.index] += plan.k.sum()  # stays a tensor until read: no extra sync
            patch.tokens[layer.index] += plan.num_tokens
            if patch.record is not None:
                patch.record.add(layer.index, plan.k, plan.entropy, logits_TE)
        return logits_TE, plan.weights.to(logits_TE.dtype), plan.expert_ids

    return forward


def _experts_forward(patch: Patch, layer: MoELayer):
    experts = layer.block.experts

    def forward(hidden_states, top_k_index=None, top_k_weights=None):
        plan = patch._pending.pop(layer.index, None)
        if plan is None:
            raise RuntimeError(f"{layer.name}.experts called without a routing plan from its patched gate")
        return run_experts(hidden_states, plan, experts.gate_up_proj, experts.down_proj, experts.act_fn)

    return forward


_MARK = "_moelab_patched"


def _through_hook(mod: torch.nn.Module, fwd):
    """`fwd` inside the module's accelerate hook (if any), as accelerate runs the original forward."""
    hook = getattr(mod, "_hf_hook", None)
    if hook is None:
        return fwd

    def forward(*args, **kwargs):
        args, kwargs = hook.pre_forward(mod, *args, **kwargs)
        if getattr(hook, "no_grad", False):
            with torch.no_grad():
                out = fwd(*args, **kwargs)
        else:
            out = fwd(*args, **kwargs)
        return hook.post_forward(mod, out)

    return forward


@contextlib.contextmanager
def patched(model, policy_or_policies, record: bool | str = False, check: bool = True):
    """Route every MoE block with moelab policies, restoring the model exactly on exit; yields a `Patch`.

    policy_or_policies: one policy, a list (one per MoE layer) or a dict {moe layer: policy} (others stay native).
    record: True keeps per-layer k and entropy, 'logits' also the router logits. check: router logits must be
    finite (a host sync per layer; False inside CUDA-graph capture). Counts and the record cover eager forwards
    only (captured ones add to `uncounted`; a recording forward cannot be captured). Ties at the k-th place go to
    the lower expert index (torch.topk leaves them unspecified).
    """
    if record not in (False, True, "logits"):
        raise ValueError(f"record={record!r}: must be False, True or 'logits'")
    layers = moe_layers(model)
    policies = _resolve_policies(layers, policy_or_policies)
    for i in policies:  # on entry, not in the first forward: the router's logits take the gate's dtype
        dt = layers[i].block.gate.weight.dtype
        if dt not in LOGIT_DTYPES:
            raise ValueError(f"{layers[i].name}: router weight dtype={dt}: patched routing takes float32, float16 "
                             "or bfloat16 (load or cast the model to one of them)")
    rec = RoutingRecord(logits=record == "logits") if record else None
    patch = Patch(layers, policies, rec)
    saved: list[tuple[torch.nn.Module, object]] = []  # (module, its own instance forward or None)
    marked: list[torch.nn.Module] = []  # blocks this call marked (a refused nesting leaves the outer marks)
    try:
        for i, pol in policies.items():
            layer = layers[i]
            if getattr(layer.block, _MARK, False):
                raise ValueError(f"{layer.name}: already patched; nested patched() contexts are not allowed")
            for mod, fwd in ((layer.block.gate, _gate_forward(patch, layer, pol, check)),
                             (layer.block.experts, _experts_forward(patch, layer))):
                saved.append((mod, mod.__dict__.get("forward")))
                mod.forward = _through_hook(mod, fwd)
            layer.block.__dict__[_MARK] = True
            marked.append(layer.block)
        yield patch
    finally:
        for mod, own in reversed(saved):
            if own is None:
                mod.__dict__.pop("forward", None)
            else:
                mod.forward = own
        for block in marked:
            block.__dict__.pop(_MARK, None)
        patch._pending.clear()
        patch.kept_pairs = {i: int(v) for i, v in patch.kept_pairs.items()}


@contextlib.contextmanager
def record_router(model, logits: bool = True):
    """Yields a RoutingRecord of each MoE layer's native k, entropy and (if logits) router logits over unchanged
    forwards (forward hooks)."""
    layers = moe_layers(model)
    rec = RoutingRecord(logits=logits)
    handles = []

    def hook_for(layer: MoELayer):
        def hook(module, args, output):
            logits_TE = output[0]
            logp_TE = torch.log_softmax(logits_TE.float(), dim=-1)
            entropy_T = -(logp_TE.exp() * logp_TE).sum(-1)
            k_T = torch.full_like(entropy_T, layer.native_k, dtype=torch.int32)
            rec.add(layer.index, k_T, entropy_T, logits_TE)

        return hook

    try:
        for layer in layers:
            handles.append(layer.block.gate.register_forward_hook(hook_for(layer)))
        yield rec
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def router_logits(model, ids: torch.Tensor, context: int) -> dict[int, torch.Tensor]:
    """Router logits [T, E] per MoE layer of the unchanged model over ids [T], in forwards of `context` tokens
    (clipped to the model's max_position_embeddings)."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"ids of shape {tuple(getattr(ids, 'shape', ()))}: need a non-empty 1-D tensor of token ids")
    context = check_int("context", context)
    check_ids(model, ids)
    context = min(context, model_context(model) or context)
    device = input_device(model)
    with record_router(model, logits=True) as rec:
        for start in range(0, ids.numel(), context):
            model(input_ids=ids[None, start : start + context].to(device), use_cache=False)
    return {layer: rec.router_logits(layer) for layer in rec.layers}

