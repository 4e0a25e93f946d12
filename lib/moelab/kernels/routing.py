"""Fused routing kernel: router logits [T, E] -> RoutingPlan in one Triton launch, no host sync.

One program routes BLOCK_T tokens: fp32 softmax (as log-softmax then exp, the reference's formula),
entropy, k_max rounds of "take the largest remaining probability, lowest index on ties" (the
reference's stable descending sort; one int64 max per round over (probability bits, reversed
index)), the policy's per-token k, the mask and the model's normalisation. Optional running
statistics (k histogram, entropy sum, tokens) are added to device tensors with atomics, so the call
can be captured in a CUDA graph. `moelab.routing.route` dispatches here on CUDA (or when the backend
is forced to 'triton'; on a CPU that needs TRITON_INTERPRET=1).

Exactness: ids, k and the tie order match `route_torch` whenever the fp32 probabilities are either
equal (ties, broken by the lower index) or apart by more than the last-bit differences of two exp
implementations; weights agree within 1e-6. Entropy is summed in another order (about 1e-7 apart).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moelab.kernels import on_device_of
from moelab.routing import EntropyAdaptiveK, Policy, RatioSkip, RoutingPlan, TopK, TopP

__all__ = ["route_triton", "RoutingStats", "MAX_K_VALUES", "MAX_EXPERTS"]

MAX_EXPERTS = 256  # one tile row holds all of a token's logits
MAX_K_VALUES = 8  # EntropyAdaptiveK levels passed as scalars (no device tensor built per call)

_TOPK, _ADAPTIVE, _TOPP, _RATIO = 0, 1, 2, 3
# launch shape: logits per program; warps 8 for E <= 16 else 4 (benchmarks/moe_kernels.py --parts tune,
# H200, data/results/routing-tune-*.json: best or within 5% at T = 4096 and 65536 for E = 8, 64, 128)
LAUNCH = {"tile": 1024, "warps": None}


@dataclass
class RoutingStats:
    """Running routing statistics kept on the device; read them with `summary()` (one host sync)."""

    k_hist: torch.Tensor  # [k_max + 1] int64, tokens that kept j experts
    entropy_sum: torch.Tensor  # [1] float64, nats
    tokens: torch.Tensor  # [1] int64

    @classmethod
    def zeros(cls, k_max: int, device) -> "RoutingStats":
        if isinstance(k_max, bool) or not isinstance(k_max, int) or k_max < 1:
            raise ValueError(f"k_max={k_max!r}: must be an int >= 1")
        return cls(
            torch.zeros(k_max + 1, dtype=torch.int64, device=device),
            torch.zeros(1, dtype=torch.float64, device=device),
            torch.zeros(1, dtype=torch.int64, device=device),
        )

    def reset(self) -> None:
        self.k_hist.zero_()
        self.entropy_sum.zero_()
        self.tokens.zero_()

    def add_torch(self, plan: RoutingPlan) -> None:
        """The reference update in torch ops (no host sync either: scatter_add, not bincount)."""
        self.k_hist.scatter_add_(0, plan.k.long(), torch.ones_like(plan.k, dtype=torch.int64))
        self.entropy_sum += plan.entropy.double().sum()
        self.tokens += plan.num_tokens

    def summary(self) -> dict:
        hist = self.k_hist.tolist()
        tokens = int(self.tokens.item())
        kept = sum(j * n for j, n in enumerate(hist))
        return {
            "tokens": tokens,
            "k_hist": hist,
            "mean_k": kept / tokens if tokens else float("nan"),
            "mean_entropy": float(self.entropy_sum.item()) / tokens if tokens else float("nan"),
        }


@triton.jit
def _route_kernel(
    logits_ptr, ids_ptr, w_ptr, k_ptr, ent_ptr,
    hist_ptr, entsum_ptr, tok_ptr,
    T, E, stride_t,
    fpar,  # TopP: p / RatioSkip: beta (fp32); unused otherwise
    th0, th1, th2, th3, th4, th5, th6,  # EntropyAdaptiveK thresholds (fp32)
    kv_packed,  # EntropyAdaptiveK k values: byte i holds k_values[i] - 1 (fewer arguments, faster launch)
    KMIN,
    POLICY: tl.constexpr, NTH: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, RENORM: tl.constexpr, STATS: tl.constexpr,
    BLOCK_K1: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    col_ok = cols < E
    ok = row_ok[:, None] & col_ok[None, :]
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_t + cols[None, :], mask=ok, other=0.0)
    x = x.to(tl.float32)
    x = tl.where(col_ok[None, :], x, float("-inf"))  # rows past T stay finite (no NaN anywhere)
    # log-softmax then exp, as torch.log_softmax(...).exp() computes it
    m = tl.max(x, axis=1)
    xs = x - m[:, None]
    s = tl.sum(tl.where(col_ok[None, :], tl.exp(xs), 0.0), axis=1)
    logp = xs - tl.log(s)[:, None]
    p = tl.exp(logp)
    ent = -tl.sum(p * tl.where(col_ok[None, :], logp, 0.0), axis=1)  # p = 0 in padding columns
    # rank key: probability bits (monotone for p >= 0) above the reversed column, so one int64 max
    # picks the largest probability and, among equal ones, the lowest expert index; -1 = taken/padding
    low = (BLOCK_E - 1 - cols).to(tl.int64)
    key = (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | low[None, :]
    key = tl.where(col_ok[None, :], key, -1)

    slots = tl.arange(0, BLOCK_K)[None, :]
    ids_tile = tl.full((BLOCK_T, BLOCK_K), -1, tl.int32)
    w_tile = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)
    cnt = tl.zeros((BLOCK_T,), tl.int32)
    csum = tl.zeros((BLOCK_T,), tl.float32)
    top = tl.max(p, axis=1)  # the first-ranked probability (RatioSkip)
    for j in range(K):
        kmax = tl.max(key, axis=1)
        key = tl.where(key == kmax[:, None], -1, key)
        i = (BLOCK_E - 1) - (kmax & 0xFFFFFFFF).to(tl.int32)
        v = (kmax >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        ids_tile = tl.where(slots == j, i[:, None].to(tl.int32), ids_tile)
        w_tile = tl.where(slots == j, v[:, None], w_tile)
        if POLICY == 2:
            csum = csum + v
            cnt += ((csum - v) < fpar).to(tl.int32)  # mass of the better-ranked experts < p
        if POLICY == 3:
            cnt += (v >= fpar * top).to(tl.int32)

    if POLICY == 0:
        k = tl.full((BLOCK_T,), K, tl.int32)
    elif POLICY == 1:
        kvp = kv_packed.to(tl.int64)
        kv0 = ((kvp & 0xFF) + 1).to(tl.int32)
        kv1 = (((kvp >> 8) & 0xFF) + 1).to(tl.int32)
        kv2 = (((kvp >> 16) & 0xFF) + 1).to(tl.int32)
        kv3 = (((kvp >> 24) & 0xFF) + 1).to(tl.int32)
        kv4 = (((kvp >> 32) & 0xFF) + 1).to(tl.int32)
        kv5 = (((kvp >> 40) & 0xFF) + 1).to(tl.int32)
        kv6 = (((kvp >> 48) & 0xFF) + 1).to(tl.int32)
        kv7 = (((kvp >> 56) & 0xFF) + 1).to(tl.int32)
        k = tl.full((BLOCK_T,), 0, tl.int32) + kv0
        if NTH > 0:
            k = tl.where(ent >= th0, kv1, k)
        if NTH > 1:
            k = tl.where(ent >= th1, kv2, k)
        if NTH > 2:
            k = tl.where(ent >= th2, kv3, k)
        if NTH > 3:
            k = tl.where(ent >= th3, kv4, k)
        if NTH > 4:
            k = tl.where(ent >= th4, kv5, k)
        if NTH > 5:
            k = tl.where(ent >= th5, kv6, k)
        if NTH > 6:
            k = tl.where(ent >= th6, kv7, k)
    else:
        k = tl.minimum(tl.maximum(cnt, KMIN), K)

    keep = slots < k[:, None]
    w_tile = tl.where(keep, w_tile, 0.0)
    ids_tile = tl.where(keep, ids_tile, -1)
    if RENORM:
        w_tile = w_tile / tl.maximum(tl.sum(w_tile, axis=1), 1e-20)[:, None]
    out_ok = row_ok[:, None] & (slots < K)
    out_off = rows[:, None].to(tl.int64) * K + slots
    tl.store(ids_ptr + out_off, ids_tile, mask=out_ok)
    tl.store(w_ptr + out_off, w_tile, mask=out_ok)
    tl.store(k_ptr + rows, k, mask=row_ok)
    tl.store(ent_ptr + rows, ent, mask=row_ok)

    if STATS:
        kk = tl.where(row_ok, k, -1)
        bins = tl.arange(0, BLOCK_K1)
        n = tl.sum((kk[:, None] == bins[None, :]).to(tl.int64), axis=0)  # this block's k histogram
        tl.atomic_add(hist_ptr + bins, n, mask=(bins <= K) & (n > 0))
        tl.atomic_add(entsum_ptr, tl.sum(tl.where(row_ok, ent, 0.0), axis=0).to(tl.float64))
        tl.atomic_add(tok_ptr, tl.sum(row_ok.to(tl.int64), axis=0))


def _pack(k_values: list[int]) -> int:
    """Eight k values (1..256) as bytes of one signed int64."""
    v = sum((k - 1) << (8 * i) for i, k in enumerate(k_values))
    return v - (1 << 64) if v >= 1 << 63 else v


def _policy_args(policy: Policy):
    """(POLICY code, fpar, thresholds[7], packed k values, NTH, KMIN): the kernel's scalar arguments."""
    th = [0.0] * (MAX_K_VALUES - 1)
    kv = [policy.k_max] * MAX_K_VALUES
    if isinstance(policy, TopK):
        return _TOPK, 0.0, th, _pack(kv), 0, policy.k
    if isinstance(policy, EntropyAdaptiveK):
        n = len(policy.k_values)
        if n > MAX_K_VALUES:
            raise ValueError(
                f"k_values={list(policy.k_values)}: the Triton kernel takes at most {MAX_K_VALUES} k values; "
                "use moelab.routing.set_backend('torch') for more"
            )
        th[: n - 1] = policy.thresholds
        kv[:n] = policy.k_values
        return _ADAPTIVE, 0.0, th, _pack(kv), n - 1, policy.k_min
    if isinstance(policy, TopP):
        return _TOPP, float(policy.p), th, _pack(kv), 0, policy.k_min
    if isinstance(policy, RatioSkip):
        return _RATIO, float(policy.beta), th, _pack(kv), 0, policy.k_min
    raise ValueError(f"policy={policy!r}: must be TopK, EntropyAdaptiveK, TopP or RatioSkip")


def block_tokens(T: int, E: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_E): about LAUNCH['tile'] logits per program, fewer tokens when T is small."""
    block_e = triton.next_power_of_2(max(E, 2))
    block_t = max(1, min(256, LAUNCH["tile"] // block_e))
    return min(block_t, triton.next_power_of_2(max(T, 1))), block_e


def route_triton(
    logits: torch.Tensor, policy: Policy, renormalize: bool, stats: RoutingStats | None = None
) -> RoutingPlan:
    """The routing plan of `route_torch`, in one launch (no validation beyond shapes; see `route`)."""
    if logits.dim() != 2:
        raise ValueError(f"logits.shape={tuple(logits.shape)}: must have rank 2 [T, E]")
    T, E = logits.shape
    K = policy.k_max
    if E > MAX_EXPERTS:
        raise ValueError(f"E={E}: the Triton routing kernel supports at most {MAX_EXPERTS} experts")
    if not 1 <= K <= E:
        raise ValueError(f"k_max={K}: must be in [1, E={E}]")
    if stats is not None and stats.k_hist.shape[0] != K + 1:
        raise ValueError(f"stats.k_hist has {stats.k_hist.shape[0]} bins: need k_max + 1 = {K + 1}")
    code, fpar, th, kv, nth, kmin = _policy_args(policy)
    dev = logits.device
    ids = torch.empty(T, K, dtype=torch.int32, device=dev)
    w = torch.empty(T, K, dtype=torch.float32, device=dev)
    k = torch.empty(T, dtype=torch.int32, device=dev)
    ent = torch.empty(T, dtype=torch.float32, device=dev)
    if T == 0:
        return RoutingPlan(ids, w, k, ent, E)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block_t, block_e = block_tokens(T, E)
    st = stats if stats is not None else None
    with on_device_of(logits):
        _route_kernel[(triton.cdiv(T, block_t),)](
            logits, ids, w, k, ent,
            st.k_hist if st else k, st.entropy_sum if st else ent, st.tokens if st else k,
            T, E, logits.stride(0),
            fpar, *th, kv, kmin,
            POLICY=code, NTH=nth, K=K, BLOCK_K=triton.next_power_of_2(K),
            BLOCK_T=block_t, BLOCK_E=block_e, RENORM=bool(renormalize), STATS=st is not None,
            BLOCK_K1=triton.next_power_of_2(K + 1),
            num_warps=LAUNCH["warps"] or (8 if block_e <= 16 else 4),
        )
    return RoutingPlan(ids, w, k, ent, E)
