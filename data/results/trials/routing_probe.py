"""Trial (data/results/trials/README.md): where the 16-bit row routing kernel's time goes at T = 65536 (bf16,
E = 64 and 128, native top-8), and three restructurings of it. Copies of main's kernel, not used by main:
  probe(mode=...): 0 main's loop; 1 only chunk 0 loaded, the other chunks its bits perturbed (the work with a
    quarter (E = 64) or an eighth (E = 128) of the reads); 2 loads and a sum only (no ranking); 3 every chunk
    loaded first, the row max first, then the chunks ranked and summed; maxk: the chunk max from its largest key.
  probe4: logits loaded as 32-bit words (two bf16), every chunk loaded first; keys of a word from one prmt and
    two lop3 (inline PTX: -0 made +0 with a bf16x2 add, sign bytes replicated, the lower column's key by one
    integer multiply-add); all chunks ranked before the sums, whose max is the largest key's logit.
  probe5: probe4's block work in persistent programs (per_sm programs per SM looping over row blocks, the next
    block's words loaded ahead in registers), optionally with prefetch.global.L2 of the block `prefetch` ahead.
Run from the repository root: PYTHONPATH=lib python data/results/trials/routing_probe.py sass|modes|p4|p5|ncu"""
import collections, json, math, os, re, subprocess, sys, tempfile
import torch
import triton
import triton.language as tl
from moelab.kernels import routing as kr
from moelab.kernels.routing import (_finish, _keys_tile, _unkey16, _key16, _sort8, _top8, _merge16, _count)


@triton.jit
def _chunk(x16, rev, m, s, t, v0, v1, v2, v3, v4, v5, v6, v7, R: tl.constexpr, CH: tl.constexpr,
           FIRST: tl.constexpr, MAXK: tl.constexpr):
    LOG2E: tl.constexpr = 1.4426950408889634
    x = x16.to(tl.float32)
    key = _key16(x16, x, rev, True)
    a, b = tl.split(tl.reshape(key, [R, 4, 2]))
    a0, a1 = tl.split(tl.reshape(a, [R, 2, 2]))
    b0, b1 = tl.split(tl.reshape(b, [R, 2, 2]))
    k0, k1 = tl.split(a0)
    k2, k3 = tl.split(a1)
    k4, k5 = tl.split(b0)
    k6, k7 = tl.split(b1)
    k0, k1, k2, k3, k4, k5, k6, k7 = _sort8(k0, k1, k2, k3, k4, k5, k6, k7)
    v0, v1, v2, v3, v4, v5, v6, v7 = _top8(v0, v1, v2, v3, v4, v5, v6, v7, k0, k1, k2, k3, k4, k5, k6, k7)
    if MAXK:  # the chunk's largest logit from its largest key (bf16: key = fp32 bits, sign-fixed, + rev)
        hi = k0 & -65536
        cmax = (hi ^ ((hi >> 31) & 0x7FFF0000)).to(tl.float32, bitcast=True)
        m_new = tl.maximum(m, cmax)
    else:
        m_new = tl.maximum(m, tl.max(x, axis=1))
    d = x - m_new[:, None]
    e = tl.exp2(d * LOG2E)
    ed = tl.sum(e * d, axis=1)
    if FIRST:
        s = tl.sum(e, axis=1)
        t = ed
    else:
        sh = tl.where(m == m_new, 0.0, m - m_new)
        a = tl.exp2(sh * LOG2E)
        t = a * (t + sh * s) + ed
        s = a * s + tl.sum(e, axis=1)
    return m_new, s, t, v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _chunk_m(x16, rev, m, s, t, v0, v1, v2, v3, v4, v5, v6, v7, R: tl.constexpr, CH: tl.constexpr):
    """As _chunk with the row max m known (all chunks in registers): plain sums, no rescaling."""
    LOG2E: tl.constexpr = 1.4426950408889634
    x = x16.to(tl.float32)
    key = _key16(x16, x, rev, True)
    a, b = tl.split(tl.reshape(key, [R, 4, 2]))
    a0, a1 = tl.split(tl.reshape(a, [R, 2, 2]))
    b0, b1 = tl.split(tl.reshape(b, [R, 2, 2]))
    k0, k1 = tl.split(a0)
    k2, k3 = tl.split(a1)
    k4, k5 = tl.split(b0)
    k6, k7 = tl.split(b1)
    k0, k1, k2, k3, k4, k5, k6, k7 = _sort8(k0, k1, k2, k3, k4, k5, k6, k7)
    v0, v1, v2, v3, v4, v5, v6, v7 = _top8(v0, v1, v2, v3, v4, v5, v6, v7, k0, k1, k2, k3, k4, k5, k6, k7)
    d = x - m[:, None]
    e = tl.exp2(d * LOG2E)
    return s + tl.sum(e, axis=1), t + tl.sum(e * d, axis=1), v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _cmax(x16):
    return tl.max(x16.to(tl.float32), axis=1)


@triton.jit
def _get(ptrs, rmask, rq, cols, c: tl.constexpr, CH: tl.constexpr, MODE: tl.constexpr):
    return tl.load(ptrs + c * CH, mask=rmask, other=0.0)


@triton.jit
def _probe_kernel(
    logits_ptr, ids_ptr, w_ptr, k_ptr, ent_ptr, T,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, CH: tl.constexpr, EC: tl.constexpr,
    SPLIT: tl.constexpr, MODE: tl.constexpr, MAXK: tl.constexpr,
):
    R: tl.constexpr = BLOCK_T * SPLIT
    CPC: tl.constexpr = EC // (CH * SPLIT)
    CPS: tl.constexpr = CPC * CH
    RB: tl.constexpr = SPLIT * CPS - 1
    pid = tl.program_id(0)
    q = tl.arange(0, R)
    rq = pid * BLOCK_T + q // SPLIT
    col0 = (q % SPLIT)[:, None] * CPS + tl.arange(0, CH)[None, :]
    ptrs = logits_ptr + rq[:, None].to(tl.int64) * EC + col0
    rmask = (rq < T)[:, None]
    m = tl.full((R,), float("-inf"), tl.float32)
    s = tl.zeros((R,), tl.float32)
    t = tl.zeros((R,), tl.float32)
    v0 = tl.full((R,), -2147483648, tl.int32)
    v1 = v0
    v2 = v0
    v3 = v0
    v4 = v0
    v5 = v0
    v6 = v0
    v7 = v0
    if MODE == 2:  # loads only
        acc = tl.zeros((R, CH), tl.float32)
        for c in tl.range(0, CPC):
            acc += tl.load(ptrs + c * CH, mask=rmask, other=0.0).to(tl.float32)
        s = tl.sum(acc, axis=1)
        m = s
        t = s
        v0 = s.to(tl.int32, bitcast=True)
    elif MODE == 3:  # every chunk loaded first (CPC <= 8)
        x0 = _get(ptrs, rmask, rq, col0, 0, CH, 0)
        x1 = x0
        x2 = x0
        x3 = x0
        x4 = x0
        x5 = x0
        x6 = x0
        x7 = x0
        if CPC > 1:
            x1 = _get(ptrs, rmask, rq, col0, 1, CH, 0)
        if CPC > 2:
            x2 = _get(ptrs, rmask, rq, col0, 2, CH, 0)
        if CPC > 3:
            x3 = _get(ptrs, rmask, rq, col0, 3, CH, 0)
        if CPC > 4:
            x4 = _get(ptrs, rmask, rq, col0, 4, CH, 0)
        if CPC > 5:
            x5 = _get(ptrs, rmask, rq, col0, 5, CH, 0)
        if CPC > 6:
            x6 = _get(ptrs, rmask, rq, col0, 6, CH, 0)
        if CPC > 7:
            x7 = _get(ptrs, rmask, rq, col0, 7, CH, 0)
        m = _cmax(x0)  # the row max first: every load is needed before any ranking
        if CPC > 1:
            m = tl.maximum(m, _cmax(x1))
        if CPC > 2:
            m = tl.maximum(m, _cmax(x2))
        if CPC > 3:
            m = tl.maximum(m, _cmax(x3))
        if CPC > 4:
            m = tl.maximum(m, _cmax(x4))
        if CPC > 5:
            m = tl.maximum(m, _cmax(x5))
        if CPC > 6:
            m = tl.maximum(m, _cmax(x6))
        if CPC > 7:
            m = tl.maximum(m, _cmax(x7))
        s, t, v0, v1, v2, v3, v4, v5, v6, v7 = _chunk_m(x0, RB - 0 * CH - col0, m, s, t, v0, v1, v2, v3, v4, v5, v6, v7, R, CH)
        if CPC > 1:
            s, t, v0, v1, v2, v3, v4, v5, v6, v7 = _chunk_m(x1, RB - 1 * CH - col0, m, s, t, v0, v1, v2, v3, v4, v5, v6, v7, R, CH)
        if CPC > 2:
            s, t, v0, v1, v2, v3, v4, v5, v6, v7 = _chunk_m(x2, RB - 2 * CH - col0, m, s, t, v0, v1, v2, v3, v4, v5, v6, v7, R, CH)
        if CPC > 3:
            s, t, v0, v1, v2, v3, v4, v5, v6, v7 = _chunk_m(x3, RB - 3 * CH - col0, m, s, t, v0, v1, v2, v3, v4, v5, v6, v7, R, CH)
        if CPC > 4:
            s, t, v0, v1, v2, v3, v4, v5, v6, v7 = _chunk_m(x4, RB - 4 * CH - col0, m, s, t, v0, v1, v2, v3, v4, v5, v6, v7, R, CH)
        if CPC > 5:
            s, t, v0, v1, v2, v3, v4, v5, v6, v7 = _chunk_m(x5, RB - 5 * CH - col0, m, s, t, v0, v1, v2, v3, v4, v5, v6, v7, R, CH)
        if CPC > 6:
            s, t, v0, v1, v2, v3, v4, v5, v6, v7 = _chunk_m(x6, RB - 6 * CH - col0, m, s, t, v0, v1, v2, v3, v4, v5, v6, v7, R, CH)
        if CPC > 7:
            s, t, v0, v1, v2, v3, v4, v5, v6, v7 = _chunk_m(x7, RB - 7 * CH - col0, m, s, t, v0, v1, v2, v3, v4, v5, v6, v7, R, CH)
    else:
        x16 = _get(ptrs, rmask, rq, col0, 0, CH, 0)
        x0 = x16
        m, s, t, v0, v1, v2, v3, v4, v5, v6, v7 = _chunk(x16, RB - col0, m, s, t, v0, v1, v2, v3, v4, v5, v6, v7, R, CH, True, MAXK)
        for c in tl.range(1, CPC):
            if MODE == 1:  # chunk 0's bits, perturbed: same layout, no load
                x16 = (x0.to(tl.int16, bitcast=True) ^ (c * 3).to(tl.int16)).to(tl.bfloat16, bitcast=True)
            else:
                x16 = tl.load(ptrs + c * CH, mask=rmask, other=0.0)
            m, s, t, v0, v1, v2, v3, v4, v5, v6, v7 = _chunk(
                x16, RB - c * CH - col0, m, s, t, v0, v1, v2, v3, v4, v5, v6, v7, R, CH, False, MAXK)
    if SPLIT > 1:
        m, s, t, v0, v1, v2, v3, v4, v5, v6, v7 = tl.reduce(
            (tl.reshape(m, [BLOCK_T, SPLIT]), tl.reshape(s, [BLOCK_T, SPLIT]), tl.reshape(t, [BLOCK_T, SPLIT]),
             tl.reshape(v0, [BLOCK_T, SPLIT]), tl.reshape(v1, [BLOCK_T, SPLIT]), tl.reshape(v2, [BLOCK_T, SPLIT]),
             tl.reshape(v3, [BLOCK_T, SPLIT]), tl.reshape(v4, [BLOCK_T, SPLIT]), tl.reshape(v5, [BLOCK_T, SPLIT]),
             tl.reshape(v6, [BLOCK_T, SPLIT]), tl.reshape(v7, [BLOCK_T, SPLIT])), 1, _merge16)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    lse = tl.log(s)
    ent = lse - t / s
    slots = tl.arange(0, BLOCK_K)[None, :]
    keys = _keys_tile(v0, v1, v2, v3, v4, v5, v6, v7, slots, K, BLOCK_T, BLOCK_K)
    x_tile = _unkey16(keys, tl.bfloat16, True)
    p_tile = tl.exp((x_tile.to(tl.float32) - m[:, None]) - lse[:, None])
    ids_tile = tl.where(slots < K, RB - (keys & 0xFFFF), -1)
    w_tile = tl.where(slots < K, p_tile, 0.0)
    cnt = _count(w_tile, w_tile, slots, 0.0, 0, K, BLOCK_T)
    _finish(ids_tile, w_tile, cnt, ent, rows, row_ok, slots, pid, ids_ptr, w_ptr, k_ptr, ent_ptr,
            k_ptr, ent_ptr, k_ptr, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, K, 1,
            0, 0, K, BLOCK_T, False, False, 16)


def probe(x, K, mode, maxk=False, tile=None, split=2, warps=None):
    T, E = x.shape
    tile = tile or (2048 if E <= 64 else 8192)
    warps = warps or (2 if E <= 64 else 4)
    block_t = tile // E
    ids = torch.empty(T, K, dtype=torch.int32, device=x.device)
    w = torch.empty(T, K, dtype=torch.float32, device=x.device)
    k = torch.empty(T, dtype=torch.int32, device=x.device)
    ent = torch.empty(T, dtype=torch.float32, device=x.device)
    _probe_kernel[(triton.cdiv(T, block_t),)](x, ids, w, k, ent, T, K=K, BLOCK_K=K, BLOCK_T=block_t, CH=8, EC=E,
                                              SPLIT=split, MODE=mode, MAXK=maxk, num_warps=warps)
    return ids, w, k, ent


# ------------------------------------------------------------------ MODE 4: words, keys first, then sums
@triton.jit
def _wkeys(w, rev_lo, rev_hi, ASM: tl.constexpr):
    """The 32-bit rank keys of the two bf16 logits in word w (lo half = the even column): -0 made +0
    (bf16x2 add of 0), negatives' magnitude bits flipped (sign bytes replicated with one prmt), the
    reversed column below. ASM False: the same keys from Triton ops (the interpreter has no inline asm)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 z, s, k; mov.b32 z, 0; add.rn.bf16x2 k, $2, z; prmt.b32 s, k, 0, 0xBB99;"
            " and.b32 s, s, 0x7FFF7FFF; xor.b32 k, k, s; mad.lo.u32 $0, k, 65536, $3;"
            " and.b32 k, k, 0xFFFF0000; or.b32 $1, k, $4; }",
            "=r,=r,r,r,r", [w, rev_lo, rev_hi], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        lo = ((w << 16).to(tl.float32, bitcast=True) + 0.0).to(tl.int32, bitcast=True)
        hi = ((w & -65536).to(tl.float32, bitcast=True) + 0.0).to(tl.int32, bitcast=True)
        return (lo ^ ((lo >> 31) & 0x7FFF0000)) + rev_lo, (hi ^ ((hi >> 31) & 0x7FFF0000)) + rev_hi


@triton.jit
def _wload(wptr, rmask, c: tl.constexpr, R: tl.constexpr):
    """Chunk c (8 logits = 4 words) of each row piece, as four [R] words."""
    x = tl.load(wptr + c * 4, mask=rmask, other=0)
    a, b = tl.split(tl.reshape(x, [R, 2, 2]))  # a: words 0, 2; b: words 1, 3
    w0, w2 = tl.split(a)
    w1, w3 = tl.split(b)
    return w0, w1, w2, w3


@triton.jit
def _wsort(w0, w1, w2, w3, rev0, v0, v1, v2, v3, v4, v5, v6, v7, FIRST: tl.constexpr, ASM: tl.constexpr):
    """The chunk's eight keys sorted and merged into the running best eight (word j holds columns 2j, 2j+1;
    rev0 = the reversed column of the chunk's first)."""
    k0, k1 = _wkeys(w0, rev0, rev0 - 1, ASM)
    k2, k3 = _wkeys(w1, rev0 - 2, rev0 - 3, ASM)
    k4, k5 = _wkeys(w2, rev0 - 4, rev0 - 5, ASM)
    k6, k7 = _wkeys(w3, rev0 - 6, rev0 - 7, ASM)
    k0, k1, k2, k3, k4, k5, k6, k7 = _sort8(k0, k1, k2, k3, k4, k5, k6, k7)
    if FIRST:
        return k0, k1, k2, k3, k4, k5, k6, k7
    return _top8(v0, v1, v2, v3, v4, v5, v6, v7, k0, k1, k2, k3, k4, k5, k6, k7)


@triton.jit
def _wsums(w0, w1, w2, w3, m, s, t):
    """Sums of e^d and d e^d over the chunk's eight logits, d = x - m (m: the row piece's max)."""
    LOG2E: tl.constexpr = 1.4426950408889634
    for_w = (w0, w1, w2, w3)
    for i in tl.static_range(4):
        w = for_w[i]
        lo = (w << 16).to(tl.float32, bitcast=True) - m
        hi = (w & -65536).to(tl.float32, bitcast=True) - m
        el = tl.exp2(lo * LOG2E)
        eh = tl.exp2(hi * LOG2E)
        s += el + eh
        t += el * lo + eh * hi
    return s, t


@triton.jit
def _p4_loads(wptr, rmask, R: tl.constexpr, CPC: tl.constexpr):
    """A block's chunks as words (CPC <= 8; unused slots repeat chunk 0)."""
    a0, a1, a2, a3 = _wload(wptr, rmask, 0, R)
    b0, b1, b2, b3 = a0, a1, a2, a3
    c0, c1, c2, c3 = a0, a1, a2, a3
    d0, d1, d2, d3 = a0, a1, a2, a3
    e0, e1, e2, e3 = a0, a1, a2, a3
    f0, f1, f2, f3 = a0, a1, a2, a3
    g0, g1, g2, g3 = a0, a1, a2, a3
    h0, h1, h2, h3 = a0, a1, a2, a3
    if CPC > 1:
        b0, b1, b2, b3 = _wload(wptr, rmask, 1, R)
    if CPC > 2:
        c0, c1, c2, c3 = _wload(wptr, rmask, 2, R)
    if CPC > 3:
        d0, d1, d2, d3 = _wload(wptr, rmask, 3, R)
    if CPC > 4:
        e0, e1, e2, e3 = _wload(wptr, rmask, 4, R)
    if CPC > 5:
        f0, f1, f2, f3 = _wload(wptr, rmask, 5, R)
    if CPC > 6:
        g0, g1, g2, g3 = _wload(wptr, rmask, 6, R)
    if CPC > 7:
        h0, h1, h2, h3 = _wload(wptr, rmask, 7, R)
    return a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, g0, g1, g2, g3, h0, h1, h2, h3


@triton.jit
def _p4_block(pid, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, g0, g1, g2, g3, h0, h1, h2, h3, ids_ptr, w_ptr, k_ptr, ent_ptr, T, q, rev0,
              K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, R: tl.constexpr, CPC: tl.constexpr,
              RB: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr):
    v0, v1, v2, v3, v4, v5, v6, v7 = _wsort(a0, a1, a2, a3, rev0, a0, a0, a0, a0, a0, a0, a0, a0, True, ASM)
    if CPC > 1:
        v0, v1, v2, v3, v4, v5, v6, v7 = _wsort(b0, b1, b2, b3, rev0 - 8, v0, v1, v2, v3, v4, v5, v6, v7, False, ASM)
    if CPC > 2:
        v0, v1, v2, v3, v4, v5, v6, v7 = _wsort(c0, c1, c2, c3, rev0 - 16, v0, v1, v2, v3, v4, v5, v6, v7, False, ASM)
    if CPC > 3:
        v0, v1, v2, v3, v4, v5, v6, v7 = _wsort(d0, d1, d2, d3, rev0 - 24, v0, v1, v2, v3, v4, v5, v6, v7, False, ASM)
    if CPC > 4:
        v0, v1, v2, v3, v4, v5, v6, v7 = _wsort(e0, e1, e2, e3, rev0 - 32, v0, v1, v2, v3, v4, v5, v6, v7, False, ASM)
    if CPC > 5:
        v0, v1, v2, v3, v4, v5, v6, v7 = _wsort(f0, f1, f2, f3, rev0 - 40, v0, v1, v2, v3, v4, v5, v6, v7, False, ASM)
    if CPC > 6:
        v0, v1, v2, v3, v4, v5, v6, v7 = _wsort(g0, g1, g2, g3, rev0 - 48, v0, v1, v2, v3, v4, v5, v6, v7, False, ASM)
    if CPC > 7:
        v0, v1, v2, v3, v4, v5, v6, v7 = _wsort(h0, h1, h2, h3, rev0 - 56, v0, v1, v2, v3, v4, v5, v6, v7, False, ASM)
    m = _unkey16(v0, tl.bfloat16, True).to(tl.float32)  # the piece's largest logit
    s = tl.zeros((R,), tl.float32)
    t = tl.zeros((R,), tl.float32)
    s, t = _wsums(a0, a1, a2, a3, m, s, t)
    if CPC > 1:
        s, t = _wsums(b0, b1, b2, b3, m, s, t)
    if CPC > 2:
        s, t = _wsums(c0, c1, c2, c3, m, s, t)
    if CPC > 3:
        s, t = _wsums(d0, d1, d2, d3, m, s, t)
    if CPC > 4:
        s, t = _wsums(e0, e1, e2, e3, m, s, t)
    if CPC > 5:
        s, t = _wsums(f0, f1, f2, f3, m, s, t)
    if CPC > 6:
        s, t = _wsums(g0, g1, g2, g3, m, s, t)
    if CPC > 7:
        s, t = _wsums(h0, h1, h2, h3, m, s, t)
    if SPLIT > 1:
        m, s, t, v0, v1, v2, v3, v4, v5, v6, v7 = tl.reduce(
            (tl.reshape(m, [BLOCK_T, SPLIT]), tl.reshape(s, [BLOCK_T, SPLIT]), tl.reshape(t, [BLOCK_T, SPLIT]),
             tl.reshape(v0, [BLOCK_T, SPLIT]), tl.reshape(v1, [BLOCK_T, SPLIT]), tl.reshape(v2, [BLOCK_T, SPLIT]),
             tl.reshape(v3, [BLOCK_T, SPLIT]), tl.reshape(v4, [BLOCK_T, SPLIT]), tl.reshape(v5, [BLOCK_T, SPLIT]),
             tl.reshape(v6, [BLOCK_T, SPLIT]), tl.reshape(v7, [BLOCK_T, SPLIT])), 1, _merge16)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    lse = tl.log(s)
    ent = lse - t / s
    slots = tl.arange(0, BLOCK_K)[None, :]
    keys = _keys_tile(v0, v1, v2, v3, v4, v5, v6, v7, slots, K, BLOCK_T, BLOCK_K)
    x_tile = _unkey16(keys, tl.bfloat16, True)
    p_tile = tl.exp((x_tile.to(tl.float32) - m[:, None]) - lse[:, None])
    ids_tile = tl.where(slots < K, RB - (keys & 0xFFFF), -1)
    w_tile = tl.where(slots < K, p_tile, 0.0)
    cnt = _count(w_tile, w_tile, slots, 0.0, 0, K, BLOCK_T)
    _finish(ids_tile, w_tile, cnt, ent, rows, row_ok, slots, pid, ids_ptr, w_ptr, k_ptr, ent_ptr,
            k_ptr, ent_ptr, k_ptr, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, K, 1,
            0, 0, K, BLOCK_T, False, False, 16)




@triton.jit
def _probe4_kernel(
    logits_ptr, ids_ptr, w_ptr, k_ptr, ent_ptr, T,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, EC: tl.constexpr,
    SPLIT: tl.constexpr, ASM: tl.constexpr,
):
    R: tl.constexpr = BLOCK_T * SPLIT
    CPC: tl.constexpr = EC // (8 * SPLIT)  # chunks per piece (<= 8)
    CPS: tl.constexpr = CPC * 8
    RB: tl.constexpr = SPLIT * CPS - 1
    pid = tl.program_id(0)
    q = tl.arange(0, R)
    rq = pid * BLOCK_T + q // SPLIT
    wcol0 = (q % SPLIT)[:, None] * (CPS // 2) + tl.arange(0, 4)[None, :]
    wptr = logits_ptr.to(tl.pointer_type(tl.int32)) + rq[:, None].to(tl.int64) * (EC // 2) + wcol0
    rmask = (rq < T)[:, None]
    rev0 = RB - (q % SPLIT) * CPS  # reversed column of the piece's first
    a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, g0, g1, g2, g3, h0, h1, h2, h3 = _p4_loads(wptr, rmask, R, CPC)
    _p4_block(pid, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, g0, g1, g2, g3, h0, h1, h2, h3, ids_ptr, w_ptr, k_ptr, ent_ptr, T, q, rev0, K, BLOCK_K, BLOCK_T, R, CPC, RB, SPLIT, ASM)


@triton.jit
def _prefetch_l2(ptrs):
    """prefetch.global.L2 of each thread's address (a hint: no register waits on it)."""
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _probe5_kernel(
    logits_ptr, ids_ptr, w_ptr, k_ptr, ent_ptr, T,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, EC: tl.constexpr,
    SPLIT: tl.constexpr, ASM: tl.constexpr, PREFETCH: tl.constexpr,
):
    """Persistent: program p routes blocks p, p + P, ...; the next block's words load before this one is ranked."""
    R: tl.constexpr = BLOCK_T * SPLIT
    CPC: tl.constexpr = EC // (8 * SPLIT)
    CPS: tl.constexpr = CPC * 8
    RB: tl.constexpr = SPLIT * CPS - 1
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    nblk = tl.cdiv(T, BLOCK_T)
    q = tl.arange(0, R)
    wcol0 = (q % SPLIT)[:, None] * (CPS // 2) + tl.arange(0, 4)[None, :]
    base = logits_ptr.to(tl.pointer_type(tl.int32)) + (q // SPLIT)[:, None].to(tl.int64) * (EC // 2) + wcol0
    rev0 = RB - (q % SPLIT) * CPS
    rq = pid * BLOCK_T + q // SPLIT
    rmask = (rq < T)[:, None]
    a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, g0, g1, g2, g3, h0, h1, h2, h3 = _p4_loads(base + pid.to(tl.int64) * (BLOCK_T * EC // 2), rmask, R, CPC)
    pbase = logits_ptr.to(tl.pointer_type(tl.int32)) + (q // SPLIT).to(tl.int64) * (EC // 2) + (q % SPLIT) * (CPS // 2)
    for blk in tl.range(pid, nblk, nprog):
        nxt = blk + nprog
        if PREFETCH > 0:  # PREFETCH blocks ahead (ptxas places the hint late in the body)
            _prefetch_l2(pbase + tl.minimum(blk + PREFETCH * nprog, nblk - 1).to(tl.int64) * (BLOCK_T * EC // 2))
        rqn = nxt * BLOCK_T + q // SPLIT
        a0n, a1n, a2n, a3n, b0n, b1n, b2n, b3n, c0n, c1n, c2n, c3n, d0n, d1n, d2n, d3n, e0n, e1n, e2n, e3n, f0n, f1n, f2n, f3n, g0n, g1n, g2n, g3n, h0n, h1n, h2n, h3n = _p4_loads(base + nxt.to(tl.int64) * (BLOCK_T * EC // 2), (rqn < T)[:, None], R, CPC)
        _p4_block(blk, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, g0, g1, g2, g3, h0, h1, h2, h3, ids_ptr, w_ptr, k_ptr, ent_ptr, T, q, rev0, K, BLOCK_K, BLOCK_T, R, CPC, RB, SPLIT, ASM)
        a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, g0, g1, g2, g3, h0, h1, h2, h3 = a0n, a1n, a2n, a3n, b0n, b1n, b2n, b3n, c0n, c1n, c2n, c3n, d0n, d1n, d2n, d3n, e0n, e1n, e2n, e3n, f0n, f1n, f2n, f3n, g0n, g1n, g2n, g3n, h0n, h1n, h2n, h3n


def probe4(x, K, rows=16, split=2, asm=True):
    T, E = x.shape
    ids = torch.empty(T, K, dtype=torch.int32, device=x.device)
    w = torch.empty(T, K, dtype=torch.float32, device=x.device)
    k = torch.empty(T, dtype=torch.int32, device=x.device)
    ent = torch.empty(T, dtype=torch.float32, device=x.device)
    _probe4_kernel[(triton.cdiv(T, rows),)](x, ids, w, k, ent, T, K=K, BLOCK_K=K, BLOCK_T=rows, EC=E, SPLIT=split,
                                            ASM=asm, num_warps=max(1, rows * split // 32))
    return ids, w, k, ent


def probe5(x, K, rows=16, split=2, per_sm=8, asm=True, programs=None, prefetch=False):
    T, E = x.shape
    ids = torch.empty(T, K, dtype=torch.int32, device=x.device)
    w = torch.empty(T, K, dtype=torch.float32, device=x.device)
    k = torch.empty(T, dtype=torch.int32, device=x.device)
    ent = torch.empty(T, dtype=torch.float32, device=x.device)
    nsm = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    grid = min(triton.cdiv(T, rows), programs or nsm * per_sm)
    _probe5_kernel[(grid,)](x, ids, w, k, ent, T, K=K, BLOCK_K=K, BLOCK_T=rows, EC=E, SPLIT=split,
                            ASM=asm, PREFETCH=prefetch, num_warps=max(1, rows * split // 32))
    return ids, w, k, ent


# ------------------------------------------------------------------ parts
ALU = {"VIMNMX", "VIMNMX3", "FMNMX", "SHF", "LOP3", "IADD3", "ISETP", "FSETP", "FSEL", "SEL", "PRMT", "VIADD", "FLO",
       "POPC", "LEA", "SGXT", "P2R", "R2P", "BMSK", "PLOP3"}  # instructions of the ALU pipe (ncu's grouping)


def _compile(fn, const, warps, loop=False):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = {"logits_ptr": "*bf16", "ids_ptr": "*i32", "w_ptr": "*fp32", "k_ptr": "*i32", "ent_ptr": "*fp32", "T": "i32"}
    sig.update({k: "constexpr" for k in const})
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i in range(5)})
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    d = tempfile.mkdtemp()
    path = os.path.join(d, "k.cubin")
    with open(path, "wb") as f:
        f.write(ck.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    text = subprocess.run([tool, "-sass", path], capture_output=True, text=True).stdout
    if loop:
        return _loop_memory_ops(text)
    ops = collections.Counter()
    for line in text.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if m:
            ops[m.group(2)] += 1
    return ops


def _loop_memory_ops(text):
    """(instructions in the first backward branch's loop body, [(position, opcode) of its loads / prefetches])."""
    lines = [ln for ln in text.splitlines() if re.match(r"\s*/\*[0-9a-f]+\*/\s+\S", ln)]
    for i, ln in enumerate(lines):
        m = re.search(r"/\*([0-9a-f]+)\*/\s+(@!?P\d\s+)?BRA\s+(0x[0-9a-f]+)", ln)
        if m and int(m.group(3), 16) < int(m.group(1), 16):
            start = next(j for j, x in enumerate(lines) if re.search(rf"/\*{int(m.group(3), 16):04x}\*/", x))
            body = lines[start:i + 1]
            return len(body), [(j, op) for j, x in enumerate(body) for op in ("LDG", "CCTL") if f" {op}" in x]
    return 0, []


def part_sass():
    """SASS (sm_90) instruction counts of probe4 per thread: the whole kernel at E = 16, 32, 64, 128 (SPLIT 2,
    so 1, 2, 4, 8 chunks per thread); the difference of E = 32 and 16 is one chunk's work."""
    print("triton", triton.__version__, flush=True)
    got = {}
    for E in (16, 32, 64, 128):
        ops = _compile(_probe4_kernel, dict(K=8, BLOCK_K=8, BLOCK_T=16, EC=E, SPLIT=2, ASM=True), 1)
        got[E] = ops
        alu = sum(v for k, v in ops.items() if k in ALU)
        print(f"probe4 E={E}: {sum(ops.values())} instructions, ALU pipe {alu}", flush=True)
    one = {k: got[32][k] - got[16][k] for k in set(got[32]) | set(got[16])}
    print("one chunk:", sum(v for k, v in one.items() if k in ALU), "ALU,",
          sorted(((v, k) for k, v in one.items() if v), reverse=True), flush=True)
    main_ops = _compile(_probe_kernel, dict(K=8, BLOCK_K=8, BLOCK_T=32, CH=8, EC=64, SPLIT=2, MODE=0, MAXK=False), 2)
    print(f"main's loop kernel (probe mode 0, E=64): {sum(main_ops.values())} instructions, ALU pipe "
          f"{sum(v for k, v in main_ops.items() if k in ALU)} (one chunk in the loop body)", flush=True)
    for pf in (0, 1):
        n, mem = _compile(_probe5_kernel, dict(K=8, BLOCK_K=8, BLOCK_T=16, EC=64, SPLIT=2, ASM=True, PREFETCH=pf), 1,
                          loop=True)
        print(f"probe5 E=64 prefetch {pf}: loop body {n} instructions, loads / prefetches at {mem}", flush=True)


def _setup(E, K=8, T=65536):
    from moelab.routing import TopK
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    g = torch.Generator(device="cuda").manual_seed(E)
    n_in = max(1, min(16, math.ceil(3 * l2 / (T * E * 2))))
    inputs = [torch.randn(T, E, device="cuda", generator=g).to(torch.bfloat16) for _ in range(n_in)]
    inputs[0][::3] = inputs[0][::3].round()  # exact ties
    inputs[0][1, :3] = torch.tensor([0.0, -0.0, 0.0])
    return inputs, max(20, n_in), kr.route_triton(inputs[0], TopK(K), False)


def part_timing(part):
    sys.path.insert(0, "benchmarks")
    from moe_kernels import copy_bandwidth_gbs, graph_us, memory_floor
    from moelab.routing import TopK
    bw = copy_bandwidth_gbs()
    print("bw", bw, torch.cuda.get_device_name(0), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    res = []
    K, T = 8, 65536
    for E in (64, 128):
        inputs, calls, ref = _setup(E, K, T)
        bound = (T * E * 2 + T * K * 8 + T * 8) / (bw * 1e9) * 1e6
        out = {"main": graph_us(lambda x: kr.route_triton(x, TopK(K), False), inputs, calls),
               "memory_floor": graph_us(lambda x: memory_floor(x, K), inputs, calls)}
        variants = []
        if part == "modes":
            tile, warps = (2048, 2) if E == 64 else (8192, 4)  # main's tuned launch
            variants += [("mode0 (main's loop)", dict(mode=0)), ("mode1 (chunk 0 read only)", dict(mode=1)),
                         ("mode2 (loads only)", dict(mode=2)), ("maxk", dict(mode=0, maxk=True))]
            variants = [(n, lambda x, kw=kw: probe(x, K, tile=tile, warps=warps, **kw)) for n, kw in variants]
            for split in (1, 2, 4):
                for rows in (16, 32, 64):
                    if 32 <= rows * split <= 256 and E // (8 * split) <= 8:
                        variants.append((f"mode3 s{split} r{rows}", lambda x, s=split, r=rows:
                                         probe(x, K, mode=3, split=s, tile=r * E, warps=r * s // 32)))
        elif part == "p4":
            for split in (1, 2, 4):
                for rows in (16, 32, 64):
                    if 32 <= rows * split <= 256 and E // (8 * split) <= 8:
                        variants.append((f"p4 s{split} r{rows}", lambda x, s=split, r=rows: probe4(x, K, rows=r, split=s)))
        else:
            variants.append(("p4 s2 r16", lambda x: probe4(x, K, rows=16, split=2)))
            for pf in (0, 1, 2):
                for rows, split in ((16, 2), (32, 2)):
                    for per_sm in (4, 8, 16):
                        variants.append((f"p5 s{split} r{rows} x{per_sm} pf{pf}", lambda x, s=split, r=rows, n=per_sm,
                                         pf=pf: probe5(x, K, rows=r, split=s, per_sm=n, prefetch=pf)))
        for name, fn in variants:
            ids, w, k, ent = fn(inputs[0])
            same = None
            if not name.startswith(("mode1", "mode2")):
                same = bool(torch.equal(ids, ref.expert_ids) and float((w - ref.weights).abs().max()) <= 1e-6
                            and float((ent - ref.entropy).abs().max()) <= 1e-5)
            out[name] = graph_us(fn, inputs, calls)
            print(f"  E={E} {name}: {out[name]:.2f} us" + ("" if same is None else f" (plan as main: {same})"), flush=True)
        print(f"E={E} bound {bound:.2f} us: " + ", ".join(f"{n} {u:.2f}" for n, u in out.items()), flush=True)
        res.append(dict(E=E, T=T, bound=bound, **out))
    with open(os.path.join(os.environ.get("OUT", "/tmp"), f"routing_probe_{part}.json"), "w") as f:
        json.dump(res, f, indent=1)


def part_ncu():
    """For ncu (routing_probe_ncu.sh): main's kernel and probe4 (s2 r16), three calls each, E = 64 then 128."""
    from moelab.routing import TopK
    for E in (64, 128):
        g = torch.Generator(device="cuda").manual_seed(E)
        x = torch.randn(65536, E, device="cuda", generator=g).to(torch.bfloat16)
        for _ in range(3):
            kr.route_triton(x, TopK(8), False)
            probe4(x, 8, rows=16, split=2)
    torch.cuda.synchronize()
    print("done")


if __name__ == "__main__":
    part = sys.argv[1]
    if part == "sass":
        part_sass()
    elif part == "ncu":
        part_ncu()
    else:
        part_timing(part)
