"""Fused routing kernel: router logits [T, E] -> RoutingPlan in one Triton launch, no host sync.

One program routes a block of tokens: fp32 softmax (as log-softmax then exp, the reference's formula), entropy,
the k_max largest probabilities with the lowest index first on ties (the reference's stable descending sort), the
policy's per-token k, the mask and the model's normalisation. Two ways find the k_max largest (`_rows_select`):
- 'rounds': on tiles of tokens x experts, k_max rounds of an int64 max over (probability bits, reversed index)
  keys (`_route_kernel`);
- 'rowwise' / 'rowsort': each thread owns whole rows and inserts each key into k_max sorted registers
  (`_route_rows_kernel`, int64 keys, fp32 logits, k_max <= 8, BLOCK_E <= 64); bf16 / fp16 logits take 32-bit
  (logit, reversed index) keys in one pass, a row split over up to 16 threads (`_route_rows16_kernel`; 'rowsort':
  chunks of eight keys sorted and merged, which also takes 8 < k_max <= 16).
Which is fastest depends on E, k_max and T: the per-device tuned table (TUNED, from kernels/configs/*.json). k_max
and the launch shape are compile-time constants; so is the policy kind, except in the fp32 row kernel, where one
compiled kernel serves every kind. Optional running statistics (k histogram, entropy sum, tokens) are added to
device tensors with atomics, so a call can be captured in a CUDA graph.

Exactness: ids, k and the tie order match `route_torch` whenever the fp32 probabilities are equal (ties, broken by
the lower index) or apart by more than the last-bit differences of two exp implementations; weights agree within
1e-6. One exception: the 16-bit row kernels rank by logit, so where two different bf16 / fp16 logits round to the
same fp32 probability they put the larger logit first (the true softmax order) where the reference puts the lower
index. Entropy is summed in another order (about 1e-6 apart).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moelab.kernels import Launcher, cdiv, device_table, load_tables, on_device_of, pow2
from moelab.plan import (
    KERNEL_MAX_EXPERTS,
    KERNEL_MAX_K,
    KERNEL_MAX_K_VALUES,
    EntropyAdaptiveK,
    Policy,
    RatioSkip,
    RoutingPlan,
    TopK,
    TopP,
    check_int,
)

__all__ = ["route_triton", "RoutingStats", "launch_config", "clear_launch_caches", "TUNED", "DEFAULT", "LAUNCH"]

_TOPK, _ADAPTIVE, _TOPP, _RATIO = 0, 1, 2, 3
# Launch per device, (BLOCK_E, BLOCK_K) and token count: [(T up to, {select, warps, tile, split})], tile = logits per
# program (rows: rows per program x BLOCK_E), split = threads per row (the 16-bit row kernel). A (BLOCK_E, BLOCK_K)
# not listed takes the entry of the same BLOCK_E with the nearest BLOCK_K; a device or shape not listed, a same-SM
# device's entries (kernels.device_table), else DEFAULT. LAUNCH overrides any of the four (benchmarks and tests).
DEFAULT = {"select": "rounds", "warps": None, "tile": 1024, "split": 1}  # warps None: 8 for E <= 16, else 4
TUNED: dict[str, dict[tuple[int, int], list]] = load_tables("routing")
LAUNCH = {"select": None, "warps": None, "tile": None, "split": None}


def launch_config(T: int, E: int, device: torch.device | None = None, K: int = 8) -> dict:
    """{select, warps, tile, split} for T tokens, E experts and k_max K: LAUNCH overrides, else the device's
    tuned entry, else DEFAULT."""
    cuda = -1 if device is None or device.type != "cuda" else (device.index or 0)
    return _launch_config(T, E, K, cuda, tuple(LAUNCH.values()))


def _tuned_entries(table: dict, block_e: int, block_k: int) -> list:
    """The table's entries for (block_e, block_k), else for block_e with the nearest BLOCK_K (the larger on a tie)."""
    same_e = [bk for be, bk in table if be == block_e]
    if not same_e:
        return []
    bk = min(same_e, key=lambda b: (abs(b.bit_length() - block_k.bit_length()), -b))
    return table[(block_e, bk)]


@functools.lru_cache(maxsize=4096)
def _launch_config(T: int, E: int, K: int, cuda: int, overrides: tuple) -> dict:
    block_e = pow2(max(E, 2))
    cfg = dict(DEFAULT)
    if cuda >= 0:
        for t_max, tuned in _tuned_entries(device_table(TUNED, cuda), block_e, pow2(K)):
            if T <= t_max:
                cfg.update(tuned)
                break
    cfg.update({k: v for k, v in LAUNCH.items() if v is not None})
    if cfg["warps"] is None:
        cfg["warps"] = 8 if block_e <= 16 else 4
    return cfg


STATS_SLOTS = 64  # programs add their statistics into slot pid % 64: less contention on the atomics


@dataclass
class RoutingStats:
    """Running routing statistics kept on the device; read them with `summary()` (one host sync). Each row is one
    slot: kernel programs spread their atomic adds over the slots, summary() adds them up."""

    k_hist: torch.Tensor  # [slots, k_max + 1] int64, tokens that kept j experts
    entropy_sum: torch.Tensor  # [slots] float64, nats
    tokens: torch.Tensor  # [slots] int64

    @classmethod
    def zeros(cls, k_max: int, device, slots: int = STATS_SLOTS) -> RoutingStats:
        k_max, slots = check_int("k_max", k_max), check_int("slots", slots)
        return cls(torch.zeros(slots, k_max + 1, dtype=torch.int64, device=device),
                   torch.zeros(slots, dtype=torch.float64, device=device),
                   torch.zeros(slots, dtype=torch.int64, device=device))

    def reset(self) -> None:
        self.k_hist.zero_()
        self.entropy_sum.zero_()
        self.tokens.zero_()

    def summary(self) -> dict:
        hist = self.k_hist.sum(0).tolist()
        tokens = int(self.tokens.sum().item())
        kept = sum(j * n for j, n in enumerate(hist))
        return {"tokens": tokens, "k_hist": hist, "mean_k": kept / tokens if tokens else float("nan"),
                "mean_entropy": float(self.entropy_sum.sum().item()) / tokens if tokens else float("nan")}


@triton.jit
def _count(w_tile, top, slots, fpar, POLICY, K: tl.constexpr, BLOCK_T: tl.constexpr):
    """TopP / RatioSkip: how many ranked slots the rule keeps (before k_min and k_max). POLICY (and NTH in
    _finish) is a constexpr in the 16-bit and tile kernels, a run-time scalar in the fp32 row kernel."""
    cnt = tl.zeros((BLOCK_T,), tl.int32)
    if POLICY == 2:  # running sum in rank order, as torch.cumsum adds them
        csum = tl.zeros((BLOCK_T,), tl.float32)
        for j in range(K):
            v = tl.sum(tl.where(slots == j, w_tile, 0.0), axis=1)
            cnt += (csum < fpar).to(tl.int32)  # mass of the better-ranked experts < p (summed, not csum - v)
            csum = csum + v
    elif POLICY == 3:
        cnt = tl.sum(((w_tile >= fpar * top[:, None]) & (slots < K)).to(tl.int32), axis=1)
    return cnt


@triton.jit
def _finish(
    ids_tile, w_tile, cnt, ent, rows, row_ok, slots, pid, ids_ptr, w_ptr, k_ptr, ent_ptr,
    hist_ptr, entsum_ptr, tok_ptr, th0, th1, th2, th3, th4, th5, th6, kv_packed, KMIN, NSLOT,
    POLICY, NTH, K: tl.constexpr, BLOCK_T: tl.constexpr, RENORM: tl.constexpr,
    STATS: tl.constexpr, BLOCK_K1: tl.constexpr,
):
    """From the ranked top-k_max (ids, weights) [BLOCK_T, BLOCK_K]: the policy's k, the mask, the
    normalisation, the stores and the statistics (shared by both kernels)."""
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
        slot = pid % NSLOT
        tl.atomic_add(hist_ptr + slot * (K + 1) + bins, n, mask=(bins <= K) & (n > 0), sem="relaxed")
        tl.atomic_add(entsum_ptr + slot, tl.sum(tl.where(row_ok, ent, 0.0), axis=0).to(tl.float64), sem="relaxed")
        tl.atomic_add(tok_ptr + slot, tl.sum(row_ok.to(tl.int64), axis=0), sem="relaxed")


@triton.jit
def _route_kernel(
    logits_ptr, ids_ptr, w_ptr, k_ptr, ent_ptr,
    hist_ptr, entsum_ptr, tok_ptr,
    T, E, stride_t,
    fpar,  # TopP: p / RatioSkip: beta (fp32); unused otherwise
    th0, th1, th2, th3, th4, th5, th6,  # EntropyAdaptiveK thresholds (fp32)
    kv_packed,  # EntropyAdaptiveK k values: byte i holds k_values[i] - 1 (fewer arguments, faster launch)
    KMIN, NSLOT,
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
    top = tl.max(p, axis=1)  # the first-ranked probability (RatioSkip)
    # K rounds of "take the largest remaining key": the largest probability, lowest index on ties
    ids_tile = tl.full((BLOCK_T, BLOCK_K), -1, tl.int32)
    w_tile = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)
    cnt = tl.zeros((BLOCK_T,), tl.int32)
    csum = tl.zeros((BLOCK_T,), tl.float32)
    for j in range(K):
        kmax = tl.max(key, axis=1)
        key = tl.where(key == kmax[:, None], -1, key)
        i = (BLOCK_E - 1) - (kmax & 0xFFFFFFFF).to(tl.int32)
        v = (kmax >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        ids_tile = tl.where(slots == j, i[:, None].to(tl.int32), ids_tile)
        w_tile = tl.where(slots == j, v[:, None], w_tile)
        if POLICY == 2:
            cnt += (csum < fpar).to(tl.int32)  # mass of the better-ranked experts < p (summed, not csum - v)
            csum = csum + v
        if POLICY == 3:
            cnt += (v >= fpar * top).to(tl.int32)

    _finish(ids_tile, w_tile, cnt, ent, rows, row_ok, slots, pid, ids_ptr, w_ptr, k_ptr, ent_ptr,
            hist_ptr, entsum_ptr, tok_ptr, th0, th1, th2, th3, th4, th5, th6, kv_packed, KMIN, NSLOT,
            POLICY, NTH, K, BLOCK_T, RENORM, STATS, BLOCK_K1)


# ------------------------------------------------------------------ one row per thread
# The tile kernel spreads a token's E logits over several threads, so every selection round is a cross-thread
# reduction. Here each thread owns whole rows: the logits come in 16-byte chunks [BLOCK_T, CH] (one vector load per
# row), tl.split takes a chunk apart into CH per-row values, and each value's int64 key is inserted into the row's
# k_max best keys (sorted in registers) by a max/min pass: 2 * K - 1 in-thread operations per logit, no shuffle, no
# shared memory. Its work grows with E * K: it wins for small E * K or many tokens. bf16 / fp16 logits take the
# 32-bit-key kernel further below.
MAX_ROWWISE_K = 8
MAX_ROWWISE_E = 64
MAX_ROWSORT_K = 16  # 16-bit logits, 'rowsort': the best eight and the next eight in registers (`_top16`)
# fp32 row kernel: chunk loops unrolled up to this T (and always for BLOCK_E <= 16): at decode sizes a call lasts one
# row's chain of loads, which unrolling issues up front; above, loops, which compile in a fraction of the time.
ROWS_UNROLL_T = 64


@triton.jit
def _ins(q, v0, v1, v2, v3, v4, v5, v6, v7, K: tl.constexpr):
    """Insert key q into the sorted keys v0 >= v1 >= ... (the first K used): each slot keeps the larger
    and passes the smaller on."""
    v0, q = _cx(v0, q)
    if K > 1:
        v1, q = _cx(v1, q)
    if K > 2:
        v2, q = _cx(v2, q)
    if K > 3:
        v3, q = _cx(v3, q)
    if K > 4:
        v4, q = _cx(v4, q)
    if K > 5:
        v5, q = _cx(v5, q)
    if K > 6:
        v6, q = _cx(v6, q)
    if K > 7:
        v7 = tl.maximum(v7, q)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _cx(a, b):
    """Compare-exchange: (larger, smaller)."""
    return tl.maximum(a, b), tl.minimum(a, b)


@triton.jit
def _ins_chunk(x, v0, v1, v2, v3, v4, v5, v6, v7, K: tl.constexpr, BLOCK_T: tl.constexpr, CH: tl.constexpr):
    """Insert the CH keys of each row of x [BLOCK_T, CH] (CH in 1, 2, 4, 8; taken apart with tl.split)."""
    if CH == 1:
        v0, v1, v2, v3, v4, v5, v6, v7 = _ins(tl.reshape(x, [BLOCK_T]), v0, v1, v2, v3, v4, v5, v6, v7, K)
    else:
        a, b = tl.split(tl.reshape(x, [BLOCK_T, CH // 2, 2]))
        v0, v1, v2, v3, v4, v5, v6, v7 = _ins_chunk(a, v0, v1, v2, v3, v4, v5, v6, v7, K, BLOCK_T, CH // 2)
        v0, v1, v2, v3, v4, v5, v6, v7 = _ins_chunk(b, v0, v1, v2, v3, v4, v5, v6, v7, K, BLOCK_T, CH // 2)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _load_chunk(ptrs, row_ok, col_ok, FULL: tl.constexpr):
    """[BLOCK_T, CH] logits as fp32, zeros past T or E (a full chunk masks by row only: one vector load)."""
    if FULL:
        x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    else:
        x = tl.load(ptrs, mask=row_ok[:, None] & col_ok, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _slot(tile, v, j: tl.constexpr, slots):
    return tl.where(slots == j, v[:, None], tile)


@triton.jit
def _sum_chunk(base, c0, cc, row_ok, m, s, EC: tl.constexpr, FULL: tl.constexpr):
    """Pass 1 over one chunk: running max and sum of exp (online softmax)."""
    ok = (c0 + cc) < EC
    x = _load_chunk(base + c0 + cc, row_ok, ok, FULL)
    if not FULL:
        x = tl.where(ok, x, float("-inf"))
    m_new = tl.maximum(m, tl.max(x, axis=1))
    s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[:, None]), axis=1)
    return m_new, s


@triton.jit
def _key_chunk(base, c0, cc, row_ok, m, lse, ent, v0, v1, v2, v3, v4, v5, v6, v7, EC: tl.constexpr,
               FULL: tl.constexpr, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, CH: tl.constexpr):
    """Pass 2 over one chunk: probabilities (log-softmax then exp), entropy, and the chunk's keys inserted.
    A key holds the probability's bits above the reversed column (distinct keys: the larger probability,
    then the lower index, wins)."""
    ok = (c0 + cc) < EC
    x = _load_chunk(base + c0 + cc, row_ok, ok, FULL)
    logp = (x - m[:, None]) - lse[:, None]
    p = tl.exp(logp)
    ent -= tl.sum(tl.where(ok, p * logp, 0.0), axis=1)
    key = (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BLOCK_E - 1 - (c0 + cc)).to(tl.int64)
    key = tl.where(ok, key, -1)
    v0, v1, v2, v3, v4, v5, v6, v7 = _ins_chunk(key, v0, v1, v2, v3, v4, v5, v6, v7, K, BLOCK_T, CH)
    return ent, v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit(do_not_specialize=["T", "kv_packed", "KMIN", "POLICY", "NTH"])
def _route_rows_kernel(
    logits_ptr, ids_ptr, w_ptr, k_ptr, ent_ptr,
    hist_ptr, entsum_ptr, tok_ptr,
    T, E, stride_t,
    fpar, th0, th1, th2, th3, th4, th5, th6, kv_packed: tl.int64, KMIN, NSLOT, POLICY, NTH,
    K: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, RENORM: tl.constexpr, STATS: tl.constexpr,
    BLOCK_K1: tl.constexpr, CH: tl.constexpr, EC: tl.constexpr, SC: tl.constexpr, UNROLL: tl.constexpr,
):
    # EC, SC: E and the row stride as constants (E and stride_t unused): whole chunks load unmasked across
    # columns, and the known row alignment makes a chunk one vector load. The policy's scalars and T are not
    # specialised on and BLOCK_T is the whole tile at every T: one compiled kernel serves every policy and batch
    # size of a k_max and launch. UNROLL: the chunk loops unrolled (few rows) or a loop (ROWS_UNROLL_T)
    FULL: tl.constexpr = EC % CH == 0
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    base = logits_ptr + rows[:, None].to(tl.int64) * SC
    cc = tl.arange(0, CH)[None, :]
    # pass 1: max and sum of exp, online over the chunks (rows past T load zeros: finite)
    m = tl.full((BLOCK_T,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_T,), tl.float32)
    if UNROLL:
        for c0 in tl.static_range(0, EC, CH):
            m, s = _sum_chunk(base, c0, cc, row_ok, m, s, EC, c0 + CH <= EC)
    else:
        for c0 in tl.range(0, EC, CH):
            m, s = _sum_chunk(base, c0, cc, row_ok, m, s, EC, FULL)
    lse = tl.log(s)
    # pass 2: entropy and the k_max best keys, kept sorted in v0 >= v1 >= ...
    ent = tl.zeros((BLOCK_T,), tl.float32)
    v0 = tl.full((BLOCK_T,), -1, tl.int64)
    v1, v2, v3, v4, v5, v6, v7 = v0, v0, v0, v0, v0, v0, v0
    if UNROLL:
        for c0 in tl.static_range(0, EC, CH):
            ent, v0, v1, v2, v3, v4, v5, v6, v7 = _key_chunk(
                base, c0, cc, row_ok, m, lse, ent, v0, v1, v2, v3, v4, v5, v6, v7, EC, c0 + CH <= EC,
                K, BLOCK_T, BLOCK_E, CH)
    else:
        for c0 in tl.range(0, EC, CH):
            ent, v0, v1, v2, v3, v4, v5, v6, v7 = _key_chunk(
                base, c0, cc, row_ok, m, lse, ent, v0, v1, v2, v3, v4, v5, v6, v7, EC, FULL, K, BLOCK_T, BLOCK_E, CH)

    slots = tl.arange(0, BLOCK_K)[None, :]
    keys = _keys_tile(v0, v1, v2, v3, v4, v5, v6, v7, slots, K, BLOCK_T, BLOCK_K)
    ids_tile = tl.where(slots < K, (BLOCK_E - 1) - (keys & 0xFFFFFFFF).to(tl.int32), -1)
    w_tile = tl.where(slots < K, (keys >> 32).to(tl.int32).to(tl.float32, bitcast=True), 0.0)
    top = (v0 >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    cnt = _count(w_tile, top, slots, fpar, POLICY, K, BLOCK_T)
    _finish(ids_tile, w_tile, cnt, ent, rows, row_ok, slots, pid, ids_ptr, w_ptr, k_ptr, ent_ptr,
            hist_ptr, entsum_ptr, tok_ptr, th0, th1, th2, th3, th4, th5, th6, kv_packed, KMIN, NSLOT,
            POLICY, NTH, K, BLOCK_T, RENORM, STATS, BLOCK_K1)


@triton.jit
def _keys_tile(v0, v1, v2, v3, v4, v5, v6, v7, slots, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """The K per-row registers as one [BLOCK_T, BLOCK_K] tile (slots past K hold v0's filler)."""
    keys = tl.zeros((BLOCK_T, BLOCK_K), v0.dtype) + v0[:, None]
    if K > 1:
        keys = _slot(keys, v1, 1, slots)
    if K > 2:
        keys = _slot(keys, v2, 2, slots)
    if K > 3:
        keys = _slot(keys, v3, 3, slots)
    if K > 4:
        keys = _slot(keys, v4, 4, slots)
    if K > 5:
        keys = _slot(keys, v5, 5, slots)
    if K > 6:
        keys = _slot(keys, v6, 6, slots)
    if K > 7:
        keys = _slot(keys, v7, 7, slots)
    return keys


@triton.jit
def _keys_tile_next(keys, l0, l1, l2, l3, l4, l5, l6, l7, slots, K: tl.constexpr):
    """Slots 8 to K - 1 of the key tile from the next eight registers (8 < K <= 16)."""
    keys = _slot(keys, l0, 8, slots)
    if K > 9:
        keys = _slot(keys, l1, 9, slots)
    if K > 10:
        keys = _slot(keys, l2, 10, slots)
    if K > 11:
        keys = _slot(keys, l3, 11, slots)
    if K > 12:
        keys = _slot(keys, l4, 12, slots)
    if K > 13:
        keys = _slot(keys, l5, 13, slots)
    if K > 14:
        keys = _slot(keys, l6, 14, slots)
    if K > 15:
        keys = _slot(keys, l7, 15, slots)
    return keys


# ------------------------------------------------------------------ rows, 16-bit logits
# For bf16 / fp16 logits a whole rank key fits in 32 bits: the logit's 16 bits (mapped so that signed
# integer order is the float order, -0 = +0) above the reversed column. Softmax is monotone, so ranking
# logits ranks probabilities; equal logits tie and go to the lower index, as in the reference. A 32-bit
# max / min is one instruction (int64: four), so the insertion costs 2 K - 1 instructions per logit, and
# the keys need no probability: max, sum of exp and the entropy's sum are kept online in the same pass
# (one read of the logits). Only the K winners are turned into probabilities.
# A row is cut into SPLIT column ranges, each scanned by its own thread; the SPLIT partial states (online sums
# and sorted keys) are merged with tl.reduce: a bitonic merge of two sorted lists keeps the best eight.
@triton.jit
def _key16(x16, x, rev, BF16: tl.constexpr):
    """int32 keys: above the reversed column rev (< 2^16), 16 bits in the float order of the logit, -0 = +0.
    bf16 (x = x16 in fp32, low 16 bits zero): from x + 0 (-0 -> +0), negatives' magnitude bits flipped
    (one LOP3); fp16: sign-magnitude -> two's complement of the 16-bit pattern."""
    if BF16:
        b = (x + 0.0).to(tl.int32, bitcast=True)
        return (b ^ ((b >> 31) & 0x7FFF0000)) + rev  # + = | (low bits zero): one IADD3 with rev's terms
    b = x16.to(tl.int16, bitcast=True).to(tl.int32)
    return (tl.where(b < 0, -32768 - b, b) << 16) + rev


@triton.jit
def _unkey16(keys, dtype: tl.constexpr, BF16: tl.constexpr):
    """The logits of `_key16`'s keys."""
    r = keys >> 16
    if BF16:
        r = r ^ ((r >> 15) & 0x7FFF)
    else:
        r = tl.where(r < 0, -32768 - r, r)
    return r.to(tl.int16).to(dtype, bitcast=True)


@triton.jit
def _chunk16(
    x16, ok, rev, m, s, t, v0, v1, v2, v3, v4, v5, v6, v7, l0, l1, l2, l3, l4, l5, l6, l7,
    K: tl.constexpr, R: tl.constexpr, CH: tl.constexpr, FIRST: tl.constexpr, MASKED: tl.constexpr,
    SORT: tl.constexpr, BF16: tl.constexpr,
):
    """One chunk [R, CH] of 16-bit logits (R row pieces): keys inserted (SORT, CH = 8: the chunk's eight keys
    sorted and merged; for 8 < K <= 16 into the best eight v and the next eight l, `_top16`); online max m, sum s
    of e^d and t of d e^d with d = x - m (all columns masked: m = -inf, s = t = 0). d is formed before scaling
    by log2(e), which keeps the weights exact at large |m|."""
    LOG2E: tl.constexpr = 1.4426950408889634
    x = x16.to(tl.float32)
    key = _key16(x16, x, rev, BF16)
    if MASKED:
        key = tl.where(ok, key, -2147483648)
        x = tl.where(ok, x, float("-inf"))
    if SORT:
        a, b = tl.split(tl.reshape(key, [R, 4, 2]))  # the eight keys of each row piece, in any order
        a0, a1 = tl.split(tl.reshape(a, [R, 2, 2]))
        b0, b1 = tl.split(tl.reshape(b, [R, 2, 2]))
        k0, k1 = tl.split(a0)
        k2, k3 = tl.split(a1)
        k4, k5 = tl.split(b0)
        k6, k7 = tl.split(b1)
        k0, k1, k2, k3, k4, k5, k6, k7 = _sort8(k0, k1, k2, k3, k4, k5, k6, k7)
        if K > 8:
            v0, v1, v2, v3, v4, v5, v6, v7, l0, l1, l2, l3, l4, l5, l6, l7 = _top16(
                v0, v1, v2, v3, v4, v5, v6, v7, l0, l1, l2, l3, l4, l5, l6, l7, k0, k1, k2, k3, k4, k5, k6, k7, K)
        else:
            v0, v1, v2, v3, v4, v5, v6, v7 = _top8(v0, v1, v2, v3, v4, v5, v6, v7, k0, k1, k2, k3, k4, k5, k6, k7)
    else:
        v0, v1, v2, v3, v4, v5, v6, v7 = _ins_chunk(key, v0, v1, v2, v3, v4, v5, v6, v7, K, R, CH)
    m_new = tl.maximum(m, tl.max(x, axis=1))
    d = x - m_new[:, None]
    e = tl.exp2(d * LOG2E)  # as tl.exp, without its fix-up for arguments below -126 (fewer instructions)
    if MASKED:
        e = tl.where(ok, e, 0.0)
        ed = tl.sum(tl.where(ok, e * d, 0.0), axis=1)
    else:
        ed = tl.sum(e * d, axis=1)
    if FIRST:
        s = tl.sum(e, axis=1)
        t = ed
    else:
        # <= 0: rescale the sums to the new max; clamped where e^sh is 0 anyway, so that sh * s stays finite
        # (bf16 logits can span 3e38: sh * s = -inf, and 0 * -inf = NaN)
        sh = tl.where(m == m_new, 0.0, tl.maximum(m - m_new, -128.0))
        a = tl.exp2(sh * LOG2E)
        t = a * (t + sh * s) + ed
        s = a * s + tl.sum(e, axis=1)
    return m_new, s, t, v0, v1, v2, v3, v4, v5, v6, v7, l0, l1, l2, l3, l4, l5, l6, l7


@triton.jit
def _top8(a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7):
    """The best eight of two descending key lists, descending: the pairwise max against the reversed
    list is bitonic; three compare-exchange stages sort it."""
    c0, c4 = _cx(tl.maximum(a0, b7), tl.maximum(a4, b3))
    c1, c5 = _cx(tl.maximum(a1, b6), tl.maximum(a5, b2))
    c2, c6 = _cx(tl.maximum(a2, b5), tl.maximum(a6, b1))
    c3, c7 = _cx(tl.maximum(a3, b4), tl.maximum(a7, b0))
    c0, c2 = _cx(c0, c2)
    c1, c3 = _cx(c1, c3)
    c4, c6 = _cx(c4, c6)
    c5, c7 = _cx(c5, c7)
    c0, c1 = _cx(c0, c1)
    c2, c3 = _cx(c2, c3)
    c4, c5 = _cx(c4, c5)
    c6, c7 = _cx(c6, c7)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _bitonic8(c0, c1, c2, c3, c4, c5, c6, c7):
    """A bitonic sequence of eight keys in descending order (12 compare-exchanges, the stages of `_top8`)."""
    c0, c4 = _cx(c0, c4)
    c1, c5 = _cx(c1, c5)
    c2, c6 = _cx(c2, c6)
    c3, c7 = _cx(c3, c7)
    c0, c2 = _cx(c0, c2)
    c1, c3 = _cx(c1, c3)
    c4, c6 = _cx(c4, c6)
    c5, c7 = _cx(c5, c7)
    c0, c1 = _cx(c0, c1)
    c2, c3 = _cx(c2, c3)
    c4, c5 = _cx(c4, c5)
    c6, c7 = _cx(c6, c7)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _top16(a0, a1, a2, a3, a4, a5, a6, a7, l0, l1, l2, l3, l4, l5, l6, l7, b0, b1, b2, b3, b4, b5, b6, b7,
           K: tl.constexpr):
    """The best K (8 < K <= 16) of a descending list (best eight a, next K - 8 in l) and eight descending keys
    b, as (best eight, next eight): a and b's pairwise max and min against the reversed b are bitonic and hold
    their best and worst eight; the next K - 8 are the best of those worst eight and l. For K - 8 <= 4 they
    come from half-cleaners of the worst eight (`_best_of_bitonic`) merged into l (`_best_of_two`), a chain
    that leaves l after two or three steps; above, the worst eight are sorted and merged (12 + 20
    compare-exchanges or maxes). A chunk's step at K = 10, in min / max: 38 + 16 + 24 + 12, against 38 + 32 at
    K <= 8."""
    c0, d0 = _cx(a0, b7)
    c1, d1 = _cx(a1, b6)
    c2, d2 = _cx(a2, b5)
    c3, d3 = _cx(a3, b4)
    c4, d4 = _cx(a4, b3)
    c5, d5 = _cx(a5, b2)
    c6, d6 = _cx(a6, b1)
    c7, d7 = _cx(a7, b0)
    c0, c1, c2, c3, c4, c5, c6, c7 = _bitonic8(c0, c1, c2, c3, c4, c5, c6, c7)
    if K - 8 <= 4:
        g0, g1, g2, g3 = _best_of_bitonic(d0, d1, d2, d3, d4, d5, d6, d7, K - 8)
        l0, l1, l2, l3 = _best_of_two(l0, l1, l2, l3, g0, g1, g2, g3, K - 8)
    else:
        d0, d1, d2, d3, d4, d5, d6, d7 = _bitonic8(d0, d1, d2, d3, d4, d5, d6, d7)
        l0, l1, l2, l3, l4, l5, l6, l7 = _top8(l0, l1, l2, l3, l4, l5, l6, l7, d0, d1, d2, d3, d4, d5, d6, d7)
    return c0, c1, c2, c3, c4, c5, c6, c7, l0, l1, l2, l3, l4, l5, l6, l7


@triton.jit
def _best_of_bitonic(d0, d1, d2, d3, d4, d5, d6, d7, J: tl.constexpr):
    """The best J <= 4 of a bitonic sequence of eight keys, descending (slots past J: any keys). A
    half-cleaner's max half is bitonic and holds the best four (4 max); for J <= 2 a second one keeps the best
    two (2 max) and a compare-exchange orders them, else the four are sorted (4 compare-exchanges)."""
    e0 = tl.maximum(d0, d4)
    e1 = tl.maximum(d1, d5)
    e2 = tl.maximum(d2, d6)
    e3 = tl.maximum(d3, d7)
    if J <= 2:
        e0, e1 = _cx(tl.maximum(e0, e2), tl.maximum(e1, e3))
    else:
        e0, e2 = _cx(e0, e2)
        e1, e3 = _cx(e1, e3)
        e0, e1 = _cx(e0, e1)
        e2, e3 = _cx(e2, e3)
    return e0, e1, e2, e3


@triton.jit
def _best_of_two(l0, l1, l2, l3, g0, g1, g2, g3, J: tl.constexpr):
    """The best J <= 4 of two descending lists (the first J of each), descending (slots past J: as l): the
    pairwise max against the reversed g is bitonic and holds them; sorted by compare-exchanges."""
    if J == 1:
        l0 = tl.maximum(l0, g0)
    elif J == 2:
        l0, l1 = _cx(tl.maximum(l0, g1), tl.maximum(l1, g0))
    elif J == 3:
        h0 = tl.maximum(l0, g2)
        h1 = tl.maximum(l1, g1)
        h2 = tl.maximum(l2, g0)
        h0, h1 = _cx(h0, h1)
        h1, l2 = _cx(h1, h2)
        l0, l1 = _cx(h0, h1)
    else:
        l0, l2 = _cx(tl.maximum(l0, g3), tl.maximum(l2, g1))
        l1, l3 = _cx(tl.maximum(l1, g2), tl.maximum(l3, g0))
        l0, l1 = _cx(l0, l1)
        l2, l3 = _cx(l2, l3)
    return l0, l1, l2, l3


@triton.jit
def _sort8(s0, s1, s2, s3, s4, s5, s6, s7):
    """Eight keys in descending order: the 19-comparator network of depth 6 (Knuth, TAOCP 5.3.4)."""
    s0, s2 = _cx(s0, s2)
    s1, s3 = _cx(s1, s3)
    s4, s6 = _cx(s4, s6)
    s5, s7 = _cx(s5, s7)
    s0, s4 = _cx(s0, s4)
    s1, s5 = _cx(s1, s5)
    s2, s6 = _cx(s2, s6)
    s3, s7 = _cx(s3, s7)
    s0, s1 = _cx(s0, s1)
    s2, s3 = _cx(s2, s3)
    s4, s5 = _cx(s4, s5)
    s6, s7 = _cx(s6, s7)
    s2, s4 = _cx(s2, s4)
    s3, s5 = _cx(s3, s5)
    s1, s4 = _cx(s1, s4)
    s3, s6 = _cx(s3, s6)
    s1, s2 = _cx(s1, s2)
    s3, s4 = _cx(s3, s4)
    s5, s6 = _cx(s5, s6)
    return s0, s1, s2, s3, s4, s5, s6, s7


@triton.jit
def _merge16(m1, s1, t1, a0, a1, a2, a3, a4, a5, a6, a7, m2, s2, t2, b0, b1, b2, b3, b4, b5, b6, b7):
    """tl.reduce combine of two column ranges' states: the online sums rescaled to the larger max, and the
    best eight of the two sorted key lists."""
    m = tl.maximum(m1, m2)
    sh1 = tl.where(m1 == m, 0.0, tl.maximum(m1 - m, -128.0))  # clamped as in `_chunk16`: e^sh is 0 there anyway
    sh2 = tl.where(m2 == m, 0.0, tl.maximum(m2 - m, -128.0))
    e1 = tl.exp(sh1)
    e2 = tl.exp(sh2)
    s = e1 * s1 + e2 * s2
    t = tl.where(s1 > 0, e1 * (t1 + sh1 * s1), 0.0) + tl.where(s2 > 0, e2 * (t2 + sh2 * s2), 0.0)
    c0, c1, c2, c3, c4, c5, c6, c7 = _top8(a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7)
    return m, s, t, c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _merge_next(m1, s1, t1, a0, a1, a2, a3, a4, a5, a6, a7, l0, l1, l2, l3, l4, l5, l6, l7,
                m2, s2, t2, b0, b1, b2, b3, b4, b5, b6, b7, n0, n1, n2, n3, n4, n5, n6, n7, J: tl.constexpr):
    """`_merge16` for 8 < K <= 16: each state's best keys as its best eight and next J = K - 8 (up to eight;
    slots a piece never filled hold keys below every real one). The sums come from `_merge16`, whose best eight
    of l and n are then used for J > 4 and compiled away below."""
    m, s, t, x0, x1, x2, x3, x4, x5, x6, x7 = _merge16(
        m1, s1, t1, l0, l1, l2, l3, l4, l5, l6, l7, m2, s2, t2, n0, n1, n2, n3, n4, n5, n6, n7)
    if J <= 4:
        l0, l1, l2, l3 = _best_of_two(l0, l1, l2, l3, n0, n1, n2, n3, J)
    else:
        l0, l1, l2, l3, l4, l5, l6, l7 = x0, x1, x2, x3, x4, x5, x6, x7
    a0, a1, a2, a3, a4, a5, a6, a7, l0, l1, l2, l3, l4, l5, l6, l7 = _top16(
        a0, a1, a2, a3, a4, a5, a6, a7, l0, l1, l2, l3, l4, l5, l6, l7, b0, b1, b2, b3, b4, b5, b6, b7, 8 + J)
    return m, s, t, a0, a1, a2, a3, a4, a5, a6, a7, l0, l1, l2, l3, l4, l5, l6, l7


# tl.reduce's combine functions take no constants: one per next-key count (K = 9 to 12, and 13 to 16 as 16)
@triton.jit
def _merge_next1(m1, s1, t1, a0, a1, a2, a3, a4, a5, a6, a7, l0, l1, l2, l3, l4, l5, l6, l7,
                 m2, s2, t2, b0, b1, b2, b3, b4, b5, b6, b7, n0, n1, n2, n3, n4, n5, n6, n7):
    return _merge_next(m1, s1, t1, a0, a1, a2, a3, a4, a5, a6, a7, l0, l1, l2, l3, l4, l5, l6, l7,
                       m2, s2, t2, b0, b1, b2, b3, b4, b5, b6, b7, n0, n1, n2, n3, n4, n5, n6, n7, 1)


@triton.jit
def _merge_next2(m1, s1, t1, a0, a1, a2, a3, a4, a5, a6, a7, l0, l1, l2, l3, l4, l5, l6, l7,
                 m2, s2, t2, b0, b1, b2, b3, b4, b5, b6, b7, n0, n1, n2, n3, n4, n5, n6, n7):
    return _merge_next(m1, s1, t1, a0, a1, a2, a3, a4, a5, a6, a7, l0, l1, l2, l3, l4, l5, l6, l7,
                       m2, s2, t2, b0, b1, b2, b3, b4, b5, b6, b7, n0, n1, n2, n3, n4, n5, n6, n7, 2)


@triton.jit
def _merge_next3(m1, s1, t1, a0, a1, a2, a3, a4, a5, a6, a7, l0, l1, l2, l3, l4, l5, l6, l7,
                 m2, s2, t2, b0, b1, b2, b3, b4, b5, b6, b7, n0, n1, n2, n3, n4, n5, n6, n7):
    return _merge_next(m1, s1, t1, a0, a1, a2, a3, a4, a5, a6, a7, l0, l1, l2, l3, l4, l5, l6, l7,
                       m2, s2, t2, b0, b1, b2, b3, b4, b5, b6, b7, n0, n1, n2, n3, n4, n5, n6, n7, 3)


@triton.jit
def _merge_next4(m1, s1, t1, a0, a1, a2, a3, a4, a5, a6, a7, l0, l1, l2, l3, l4, l5, l6, l7,
                 m2, s2, t2, b0, b1, b2, b3, b4, b5, b6, b7, n0, n1, n2, n3, n4, n5, n6, n7):
    return _merge_next(m1, s1, t1, a0, a1, a2, a3, a4, a5, a6, a7, l0, l1, l2, l3, l4, l5, l6, l7,
                       m2, s2, t2, b0, b1, b2, b3, b4, b5, b6, b7, n0, n1, n2, n3, n4, n5, n6, n7, 4)


@triton.jit
def _merge_next8(m1, s1, t1, a0, a1, a2, a3, a4, a5, a6, a7, l0, l1, l2, l3, l4, l5, l6, l7,
                 m2, s2, t2, b0, b1, b2, b3, b4, b5, b6, b7, n0, n1, n2, n3, n4, n5, n6, n7):
    return _merge_next(m1, s1, t1, a0, a1, a2, a3, a4, a5, a6, a7, l0, l1, l2, l3, l4, l5, l6, l7,
                       m2, s2, t2, b0, b1, b2, b3, b4, b5, b6, b7, n0, n1, n2, n3, n4, n5, n6, n7, 8)


@triton.jit
def _load16(ptrs, rmask, ok, MASKED: tl.constexpr):
    """One chunk of 16-bit logits; masked rows and (MASKED) columns read as 0."""
    if MASKED:
        return tl.load(ptrs, mask=rmask & ok, other=0.0)
    return tl.load(ptrs, mask=rmask, other=0.0)


@triton.jit(do_not_specialize=["T", "kv_packed", "KMIN"])
def _route_rows16_kernel(
    logits_ptr, ids_ptr, w_ptr, k_ptr, ent_ptr,
    hist_ptr, entsum_ptr, tok_ptr,
    T, E, stride_t,
    fpar, th0, th1, th2, th3, th4, th5, th6, kv_packed: tl.int64, KMIN, NSLOT,
    POLICY: tl.constexpr, NTH: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, RENORM: tl.constexpr, STATS: tl.constexpr,
    BLOCK_K1: tl.constexpr, CH: tl.constexpr, EC: tl.constexpr, SC: tl.constexpr, SPLIT: tl.constexpr,
    SORT: tl.constexpr,
):
    # as _route_rows_kernel (EC, SC: E and the row stride as constants), for bf16 / fp16 logits. T, kv_packed
    # and KMIN are not specialised on: batch sizes that share a token tile share one compile. The program's
    # R = BLOCK_T * SPLIT row pieces are rows-major (a row's pieces in neighbouring threads: the merge is a warp
    # shuffle); piece s of a row scans columns [s * CPS, (s + 1) * CPS), CPC chunks of CH
    R: tl.constexpr = BLOCK_T * SPLIT
    CPC: tl.constexpr = (EC + CH * SPLIT - 1) // (CH * SPLIT)
    CPS: tl.constexpr = CPC * CH
    RB: tl.constexpr = SPLIT * CPS - 1  # reversed column = RB - column (< 2^16)
    MASKED: tl.constexpr = SPLIT * CPS != EC
    BF16: tl.constexpr = logits_ptr.dtype.element_ty == tl.bfloat16
    pid = tl.program_id(0)
    q = tl.arange(0, R)
    rq = pid * BLOCK_T + q // SPLIT
    col0 = (q % SPLIT)[:, None] * CPS + tl.arange(0, CH)[None, :]  # [R, CH]
    ptrs = logits_ptr + rq[:, None].to(tl.int64) * SC + col0
    rmask = (rq < T)[:, None]
    m = tl.full((R,), float("-inf"), tl.float32)
    s = tl.zeros((R,), tl.float32)
    t = tl.zeros((R,), tl.float32)
    v0 = tl.full((R,), -2147483648, tl.int32)  # below every key
    v1, v2, v3, v4, v5, v6, v7 = v0, v0, v0, v0, v0, v0, v0
    # the next eight keys (8 < K <= 16); for K <= 8 carried through unchanged, and compiled away
    l0, l1, l2, l3, l4, l5, l6, l7 = v0, v0, v0, v0, v0, v0, v0, v0
    # the first chunk starts the online sums; the others go through a loop, not unrolled (compile time)
    ok = col0 < EC
    x16 = _load16(ptrs, rmask, ok, MASKED)
    m, s, t, v0, v1, v2, v3, v4, v5, v6, v7, l0, l1, l2, l3, l4, l5, l6, l7 = _chunk16(
        x16, ok, RB - col0, m, s, t, v0, v1, v2, v3, v4, v5, v6, v7, l0, l1, l2, l3, l4, l5, l6, l7,
        K, R, CH, True, MASKED, SORT, BF16)
    for c in tl.range(1, CPC):
        ok = (col0 + c * CH) < EC
        x16 = _load16(ptrs + c * CH, rmask, ok, MASKED)
        m, s, t, v0, v1, v2, v3, v4, v5, v6, v7, l0, l1, l2, l3, l4, l5, l6, l7 = _chunk16(
            x16, ok, RB - c * CH - col0, m, s, t, v0, v1, v2, v3, v4, v5, v6, v7, l0, l1, l2, l3, l4, l5, l6, l7,
            K, R, CH, False, MASKED, SORT, BF16)
    if SPLIT > 1:  # [R] row pieces -> [BLOCK_T, SPLIT], merged along the pieces
        B: tl.constexpr = BLOCK_T
        S: tl.constexpr = SPLIT
        sums = (tl.reshape(m, [B, S]), tl.reshape(s, [B, S]), tl.reshape(t, [B, S]))
        best = (tl.reshape(v0, [B, S]), tl.reshape(v1, [B, S]), tl.reshape(v2, [B, S]), tl.reshape(v3, [B, S]),
                tl.reshape(v4, [B, S]), tl.reshape(v5, [B, S]), tl.reshape(v6, [B, S]), tl.reshape(v7, [B, S]))
        if K > 8:
            nxt = (tl.reshape(l0, [B, S]), tl.reshape(l1, [B, S]), tl.reshape(l2, [B, S]), tl.reshape(l3, [B, S]),
                   tl.reshape(l4, [B, S]), tl.reshape(l5, [B, S]), tl.reshape(l6, [B, S]), tl.reshape(l7, [B, S]))
            if K == 9:
                m, s, t, v0, v1, v2, v3, v4, v5, v6, v7, l0, l1, l2, l3, l4, l5, l6, l7 = tl.reduce(
                    sums + best + nxt, 1, _merge_next1)
            elif K == 10:
                m, s, t, v0, v1, v2, v3, v4, v5, v6, v7, l0, l1, l2, l3, l4, l5, l6, l7 = tl.reduce(
                    sums + best + nxt, 1, _merge_next2)
            elif K == 11:
                m, s, t, v0, v1, v2, v3, v4, v5, v6, v7, l0, l1, l2, l3, l4, l5, l6, l7 = tl.reduce(
                    sums + best + nxt, 1, _merge_next3)
            elif K == 12:
                m, s, t, v0, v1, v2, v3, v4, v5, v6, v7, l0, l1, l2, l3, l4, l5, l6, l7 = tl.reduce(
                    sums + best + nxt, 1, _merge_next4)
            else:
                m, s, t, v0, v1, v2, v3, v4, v5, v6, v7, l0, l1, l2, l3, l4, l5, l6, l7 = tl.reduce(
                    sums + best + nxt, 1, _merge_next8)
        else:
            m, s, t, v0, v1, v2, v3, v4, v5, v6, v7 = tl.reduce(sums + best, 1, _merge16)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    lse = tl.log(s)
    ent = lse - t / s  # -sum p log p = log s - sum p (x - m)

    slots = tl.arange(0, BLOCK_K)[None, :]
    keys = _keys_tile(v0, v1, v2, v3, v4, v5, v6, v7, slots, K, BLOCK_T, BLOCK_K)
    if K > 8:
        keys = _keys_tile_next(keys, l0, l1, l2, l3, l4, l5, l6, l7, slots, K)
    x_tile = _unkey16(keys, logits_ptr.dtype.element_ty, BF16)
    p_tile = tl.exp((x_tile.to(tl.float32) - m[:, None]) - lse[:, None])  # the tile kernel's formula
    ids_tile = tl.where(slots < K, RB - (keys & 0xFFFF), -1)
    w_tile = tl.where(slots < K, p_tile, 0.0)
    top = tl.max(w_tile, axis=1)
    cnt = _count(w_tile, top, slots, fpar, POLICY, K, BLOCK_T)
    _finish(ids_tile, w_tile, cnt, ent, rows, row_ok, slots, pid, ids_ptr, w_ptr, k_ptr, ent_ptr,
            hist_ptr, entsum_ptr, tok_ptr, th0, th1, th2, th3, th4, th5, th6, kv_packed, KMIN, NSLOT,
            POLICY, NTH, K, BLOCK_T, RENORM, STATS, BLOCK_K1)


def _pack(k_values: list[int]) -> int:
    """Eight k values (1..256) as bytes of one signed int64."""
    v = sum((k - 1) << (8 * i) for i, k in enumerate(k_values))
    return v - (1 << 64) if v >= 1 << 63 else v


@functools.lru_cache(maxsize=256)
def _policy_args(policy: Policy):
    """(POLICY code, fpar, thresholds[7], packed k values, NTH, KMIN): the kernel's scalar arguments, derived once
    per policy (policies are frozen, hashable dataclasses)."""
    th = (0.0,) * (KERNEL_MAX_K_VALUES - 1)
    kv = [policy.k_max] * KERNEL_MAX_K_VALUES
    if isinstance(policy, TopK):
        return _TOPK, 0.0, th, _pack(kv), 0, policy.k
    if isinstance(policy, EntropyAdaptiveK):
        n = len(policy.k_values)
        if n > KERNEL_MAX_K_VALUES:
            raise ValueError(f"k_values={list(policy.k_values)}: the Triton kernel takes at most {KERNEL_MAX_K_VALUES} "
                             "k values; use moelab.routing.set_backend('torch') for more")
        th = tuple(policy.thresholds) + th[n - 1:]
        kv[:n] = policy.k_values
        return _ADAPTIVE, 0.0, th, _pack(kv), n - 1, policy.k_min
    if isinstance(policy, TopP):
        return _TOPP, float(policy.p), th, _pack(kv), 0, policy.k_min
    if isinstance(policy, RatioSkip):
        return _RATIO, float(policy.beta), th, _pack(kv), 0, policy.k_min
    raise ValueError(f"policy={policy!r}: must be TopK, EntropyAdaptiveK, TopP or RatioSkip")


SELECTS = ("rounds", "rowwise", "rowsort")


def _rows_select(K: int, sel: str, block_e: int = 0, elsize: int = 4) -> bool:
    """Whether the selection `sel` runs a row kernel here (else 'rounds'): 'rowwise' for K <= 8 and, for fp32
    logits, BLOCK_E <= 64; 'rowsort' the same, and for 16-bit logits also 8 < K <= 16 (chunks of eight keys sorted
    and merged)."""
    if sel not in SELECTS:
        raise ValueError(f"select={sel!r}: must be one of {SELECTS}")
    if sel == "rowsort" and elsize == 2 and MAX_ROWWISE_K < K <= MAX_ROWSORT_K:
        return True
    return sel != "rounds" and K <= MAX_ROWWISE_K and (elsize == 2 or block_e <= MAX_ROWWISE_E)


def block_tokens(T: int | None, E: int, tile: int = 1024) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_E): about `tile` logits per program, fewer tokens when T is small (T None: the whole tile)."""
    block_e = pow2(max(E, 2))
    block_t = max(1, min(256, tile // block_e))
    return (block_t if T is None else min(block_t, pow2(max(T, 1)))), block_e


def route_triton(
    logits: torch.Tensor, policy: Policy, renormalize: bool, stats: RoutingStats | None = None
) -> RoutingPlan:
    """The routing plan of `route_torch`, in one launch (no validation beyond shapes and limits; see `route`).

    Host time: a call's launch is derived once per key (dtype, alignment, shape, policy, overrides; `_prepare`);
    from a key's third call on, a call only allocates the plan and launches the bound kernel (`Launcher.bind`)."""
    if logits.dim() != 2:
        raise ValueError(f"logits.shape={tuple(logits.shape)}: must have rank 2 [T, E]")
    T, E = logits.shape
    key = prep = None
    if stats is None and T:
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        key = (logits.dtype, logits.data_ptr() % 16 == 0, T, E, logits.stride(0), logits.get_device(), policy,
               renormalize, tuple(LAUNCH.values()))
        prep = _PREPARED.get(key)
        if prep is not None and prep.direct is not None and not prep.launch.disabled:
            ids, w, k, ent = _plan_buffers(T, prep.K, logits.device)
            kp, ep = k.data_ptr(), ent.data_ptr()
            with on_device_of(logits):  # the statistics slots take the plan's own k / entropy (STATS off)
                prep.direct(logits.data_ptr(), ids.data_ptr(), w.data_ptr(), kp, ep, kp, ep, kp)
            return RoutingPlan(ids, w, k, ent, E)
    K = policy.k_max
    if E > KERNEL_MAX_EXPERTS:
        raise ValueError(f"E={E}: the Triton routing kernel supports at most {KERNEL_MAX_EXPERTS} experts; "
                         "route with moelab.routing.set_backend('torch')")
    if not 1 <= K <= E:
        raise ValueError(f"k_max={K}: must be in [1, E={E}]")
    if K > KERNEL_MAX_K:
        raise ValueError(f"k_max={K}: the Triton routing kernel takes at most {KERNEL_MAX_K} slots (k values travel "
                         "as bytes); route with moelab.routing.set_backend('torch')")
    if stats is not None and (stats.k_hist.dim() != 2 or stats.k_hist.shape[1] != K + 1):
        raise ValueError(f"stats.k_hist of shape {tuple(stats.k_hist.shape)}: need [slots, k_max + 1 = {K + 1}]")
    if stats is not None and not (stats.k_hist.device == stats.entropy_sum.device == stats.tokens.device
                                  == logits.device):
        raise ValueError(f"stats on {stats.k_hist.device}, logits on {logits.device}: must be on the same device")
    if T == 0:
        _policy_args(policy)  # a bad policy fails on an empty batch too
        return RoutingPlan(*_plan_buffers(0, K, logits.device), E)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if prep is None:
        prep = _prepare(logits, T, E, K, policy, renormalize, stats)
        if key is not None:
            if len(_PREPARED) >= 4096:  # keys hold T: bounded, whatever token counts come
                _PREPARED.clear()
            _PREPARED[key] = prep
    ids, w, k, ent = _plan_buffers(T, K, logits.device)
    st = stats
    args = (logits, ids, w, k, ent, st.k_hist if st else k, st.entropy_sum if st else ent, st.tokens if st else k,
            T, E, logits.stride(0), *prep.scalars)
    launch = prep.launch
    with on_device_of(logits):
        if prep.entry is not None:  # a key's second call: the direct path, then bound for the calls after it
            launch.run(prep.entry, prep.grid, args, prep.meta, prep.warps)
            prep.direct = launch.bind(prep.entry, prep.grid, args)
        else:
            entry = launch(prep.grid, args, prep.meta, prep.warps, _VARYING_STATS if st else _VARYING)
            if key is not None:
                prep.entry = entry
    return RoutingPlan(ids, w, k, ent, E)


_PREPARED: dict = {}  # route_triton's call key -> _Prepared


class _Prepared:
    """A routing call's launch, derived once per key: launcher, grid, the policy's scalar arguments,
    constexprs, warps; the compiled entry after the first call, its bound launch after the second."""

    __slots__ = ("launch", "grid", "scalars", "meta", "warps", "K", "entry", "direct")

    def __init__(self, launch, grid, scalars, meta, warps, K):
        self.launch, self.grid, self.scalars, self.meta, self.warps, self.K = launch, grid, scalars, meta, warps, K
        self.entry = self.direct = None


def _prepare(logits, T: int, E: int, K: int, policy: Policy, renormalize: bool, stats: RoutingStats | None):
    """The _Prepared launch of a routing call."""
    code, fpar, th, kv, nth, kmin = _policy_args(policy)
    launch, grid, shape_meta, warps = _shape_launch(
        T, E, K, logits.get_device(), tuple(LAUNCH.values()), logits.element_size(), logits.stride(0))
    scalars = (fpar, *th, kv, kmin, stats.k_hist.shape[0] if stats else 1)
    meta = dict(shape_meta)
    if launch is _launch_rows:  # the fp32 row kernel takes the policy at run time (one compile for all)
        scalars += (code, nth)
    else:
        meta.update(POLICY=code, NTH=nth)
    meta.update(RENORM=bool(renormalize), STATS=stats is not None)
    return _Prepared(launch, grid, scalars, meta, warps, K)


def clear_launch_caches() -> None:
    """Forget every derived launch (after TUNED, DEFAULT or ROWS_UNROLL_T change at run time; LAUNCH is in the
    keys)."""
    _launch_config.cache_clear()
    _shape_launch.cache_clear()
    _PREPARED.clear()


@functools.lru_cache(maxsize=4096)  # host time: derived once per shape
def _shape_launch(T: int, E: int, K: int, cuda: int, overrides: tuple, elsize: int, stride: int):
    """(launcher, grid, the shape's constexprs, warps) for T tokens of E logits (elsize bytes, row stride)."""
    cfg = _launch_config(T, E, K, cuda, overrides)
    block_t, block_e = block_tokens(T, E, cfg["tile"])
    rows = _rows_select(K, cfg["select"], block_e, elsize)
    meta = dict(K=K, BLOCK_K=pow2(K), BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K1=pow2(K + 1))
    ch = min(block_e, 16 // elsize, (stride & -stride) or 16)  # one 16-byte load per row (and split) and chunk
    if not rows or (K > MAX_ROWWISE_K and ch != 8):  # K > 8 merges whole 8-key chunks only
        return _launch, (cdiv(T, block_t),), meta, cfg["warps"]
    meta.update(CH=ch, EC=E, SC=stride)
    if elsize == 2:
        meta["SPLIT"] = max(1, min(cfg["split"], block_e // ch))
        meta["SORT"] = cfg["select"] == "rowsort" and ch == 8 and pow2(K) in (8, 16)
        return _launch_rows16, (cdiv(T, block_t),), meta, cfg["warps"]
    # the int64-key row kernel (fp32, and fp64 logits where a caller passes them): its whole tile at every T (rows
    # past T are masked, T not specialised on), so a decode loop's batch sizes share one compile per k_max
    meta["UNROLL"] = T <= ROWS_UNROLL_T or block_e <= 16
    block_t = meta["BLOCK_T"] = block_tokens(None, E, cfg["tile"])[0]
    return _launch_rows, (cdiv(T, block_t),), meta, cfg["warps"]


_launch = Launcher(_route_kernel)
_launch_rows = Launcher(_route_rows_kernel)
_launch_rows16 = Launcher(_route_rows16_kernel)
# arguments whose Triton specialisation can change between calls: logits (a view: any alignment), T, E, the row
# stride, the packed k values and k_min; the plan buffers are fresh allocations (always aligned), the policy's other
# scalars are floats or kept in the key through the constexprs, except the fp32 row kernel's POLICY and NTH
# (arguments 22, 23), which it does not specialise on, as for kv_packed and KMIN (stats: check all)
_VARYING = (0, 8, 9, 10, 19, 20)
_VARYING_STATS = _VARYING + (5, 6, 7, 21)  # and the statistics tensors (a caller's own) and their slot count


def _plan_buffers(T: int, K: int, device):
    """ids [T, K] int32, weights [T, K] fp32, k [T] int32, entropy [T] fp32 (four allocations: on the host that is
    cheaper than one allocation cut into four views)."""
    return (torch.empty(T, K, dtype=torch.int32, device=device), torch.empty(T, K, dtype=torch.float32, device=device),
            torch.empty(T, dtype=torch.int32, device=device), torch.empty(T, dtype=torch.float32, device=device))
