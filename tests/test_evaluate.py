"""Evaluation: sliding-window perplexity, measured perplexity and compute with routing changed, and estimates
from recorded routers."""

import math
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import MixtralConfig, MixtralForCausalLM

from moelab.compute import expert_reduction
from moelab.evaluate import (
    bootstrap_ppl,
    confirm_estimates,
    evaluate,
    evaluate_many,
    perplexity,
    policy_label,
    ppl_change_ci,
    router_sample,
    token_ids,
    windows,
)
from moelab.hf import moe_layers, patched, record_router
from moelab.models import tiny_random
from moelab.routing import EntropyAdaptiveK, RatioSkip, TopK, TopP, route_torch

CTX = 64


@pytest.fixture(scope="module")
def model():
    m = tiny_random("mixtral", num_hidden_layers=3)
    for layer in moe_layers(m):  # a spread of router entropies
        torch.nn.init.normal_(layer.block.gate.weight, std=0.4)
    return m


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (320,), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def base(model, ids):
    return evaluate(model, None, ids, context=CTX, stride=CTX // 2, progress=False)


def test_baseline_is_plain_perplexity(model, ids, base):
    ref = perplexity(model, None, ids, context=CTX, stride=CTX // 2, progress=False)
    assert base.summary["ppl"] == pytest.approx(ref["ppl"], rel=1e-6)  # batch 8 vs 1: float noise
    assert base.summary["scored_tokens"] == ref["scored_tokens"] == 319
    assert base.summary["mean_k"] == 2 and base.summary["expert_reduction"] == 0
    assert base.summary["forward_reduction"] == pytest.approx(0.0)
    assert base.summary["routed_tokens"] == ref["forwarded_tokens"]
    assert set(base.layers["layer"]) == {0, 1, 2}
    q = base.layers[["ent_q05", "ent_q50", "ent_q95"]].to_numpy()
    assert (q[:, 0] <= q[:, 1]).all() and (q[:, 1] <= q[:, 2]).all() and q.max() <= torch.log(torch.tensor(8.0))


def test_native_topk_patched_equals_baseline(model, ids, base):
    """The model's own TopK through moelab gives the unchanged perplexity; a numpy baseline is a number."""
    ev = evaluate(model, TopK(2), ids, context=CTX, stride=CTX // 2, baseline_ppl=np.float32(base.summary["ppl"]),
                  progress=False)
    assert ev.summary["ppl_change"] == pytest.approx(0.0, abs=1e-5)
    assert ev.summary["mean_k"] == 2.0


@pytest.mark.parametrize("bad", [0, -3.0, float("nan"), True, "230"])
def test_bad_baseline_ppl_raises_before_the_run(model, ids, bad):
    with pytest.raises(ValueError, match="baseline_ppl=.*: must be a finite perplexity > 0"):
        evaluate(model, TopK(1), ids, context=CTX, baseline_ppl=bad, progress=False)


def test_top1_halves_expert_work_and_changes_ppl(model, ids, base):
    ev = evaluate(model, TopK(1), ids, context=CTX, stride=CTX // 2, baseline_ppl=base.summary["ppl"], progress=False)
    s = ev.summary
    assert s["mean_k"] == 1.0 and s["expert_reduction"] == 0.5
    assert 0 < s["forward_reduction"] < 0.5  # attention, embeddings and router are not skipped
    assert abs(s["ppl_change"]) > 1e-4
    assert s["ppl_change"] == pytest.approx(s["ppl"] / base.summary["ppl"] - 1, rel=1e-12)
    hist = ev.k_hist[ev.k_hist.tokens > 0]
    assert set(hist["k"]) == {1} and (hist["fraction"] == 1.0).all()
    assert policy_label(TopK(1)) == s["label"] == "TopK k=1"


def test_compute_is_counted_at_the_windows_that_ran(model, ids):
    """A text shorter than the context runs as one short window: its whole-forward share is that window's,
    whatever context was asked for, and the estimate from a recording of the same text agrees."""
    short = ids[:40]
    asked = evaluate(model, TopK(1), short, context=CTX, stride=CTX, progress=False).summary
    exact = evaluate(model, TopK(1), short, context=40, stride=40, progress=False).summary
    assert asked["ppl"] == exact["ppl"] and asked["forward_reduction"] == exact["forward_reduction"]
    longer = evaluate(model, TopK(1), ids, context=CTX, stride=CTX, progress=False).summary
    assert asked["forward_reduction"] > longer["forward_reduction"]  # less attention per token: a larger share
    est = router_sample(model, short, context=CTX, progress=False).estimate(TopK(1))
    assert est["forward_reduction"] == pytest.approx(asked["forward_reduction"], rel=1e-12)
    res = perplexity(model, None, ids[:150], context=CTX, stride=CTX, progress=False)  # windows of 64, 64, 22
    assert (res["forwarded_tokens"], res["longest_window"]) == (150, 64)
    assert res["attended_mean"] == pytest.approx((2 * 64 * 65 / 2 + 22 * 23 / 2) / 150)


def test_estimates(model, ids):
    ids = ids[:256]
    sample = router_sample(model, ids, context=CTX, progress=False)
    assert sample.num_tokens == 256 and sample.num_layers == 3 and sample.unused_tokens == 0
    short = router_sample(model, ids[:220], context=CTX, progress=False)  # 3 whole chunks and 28 tokens
    assert (short.num_tokens, short.unused_tokens) == (192, 28)
    assert sample.estimate(TopK(1))["mean_k"] == 1.0
    load = sample.expert_load()
    assert load.shape == (3, 8) and (load.sum(1) == 256 * 2).all()
    med = float(sample.entropy[0].median())
    pol = EntropyAdaptiveK((1, 2, 4), (med - 0.1, med + 0.1))
    est = sample.estimate(pol)
    assert est["estimated"] is True and 1 < est["mean_k"] < 4
    pols = [pol, TopP(0.6, 4), RatioSkip(0.5, 4)]
    layers = moe_layers(model)
    chunks = ids.view(-1, CTX)  # the sample's chunks, the windows evaluate runs at stride = context too

    @torch.no_grad()
    def forwards():
        # in batches of 8, as router_sample and evaluate run them (their default batch_size), so that the router
        # logits are bitwise theirs (one chunk at a time, later layers' logits differ in the last bits)
        for b in range(0, len(chunks), 8):
            model(input_ids=chunks[b : b + 8], use_cache=False)

    with record_router(model) as rec:
        forwards()
    own = [rec.router_logits(layer.index) for layer in layers]
    # an estimate is, in every layer, the policy's k (route_torch, the reference) on the unchanged model's router
    # logits of the same chunks
    for p in pols:
        want = [route_torch(own[i], p, layer.renormalize).k for i, layer in enumerate(layers)]
        assert all(torch.equal(sample.k(p, i), want[i]) for i in range(len(layers)))
        assert sample.estimate(p)["mean_k_layers"] == [float(k.float().mean()) for k in want]
        load = sample.expert_load(p)
        for i, layer in enumerate(layers):
            kept = route_torch(own[i], p, layer.renormalize).expert_ids
            assert load[i].tolist() == torch.bincount(kept[kept >= 0].long(), minlength=8).tolist()
    conf = confirm_estimates(model, sample, pols, ids, context=CTX, stride=CTX, progress=False)
    assert len(conf) == 3 and set(conf.columns) >= {"est_mean_k", "mean_k", "est_error"}
    native_k = layers[0].native_k
    for p, (_, row) in zip(pols, conf.iterrows()):
        with patched(model, p, record="logits") as live:
            forwards()
        seen = [live.record.router_logits(layer.index) for layer in layers]
        # layer 0 routes the same input patched or not; later layers' inputs changed with the earlier routing
        assert torch.equal(seen[0], own[0]) and not any(torch.equal(seen[i], own[i]) for i in range(1, len(layers)))
        measured = [float(route_torch(seen[i], p, lay.renormalize).k.float().mean()) for i, lay in enumerate(layers)]
        assert row["mean_k"] == float(np.mean(measured))  # evaluate counted the k those logits give
        # so the estimate's error is exactly what those changed inputs do to the policy's k: none in layer 0
        estimated = sample.estimate(p)["mean_k_layers"]
        assert row["est_error_layers"][0] == 0.0
        assert row["est_error_layers"] == [expert_reduction(e, native_k) - expert_reduction(m, native_k)
                                           for e, m in zip(estimated, measured)]
        assert row["est_error"] == expert_reduction(float(np.mean(estimated)), native_k) - row["expert_reduction"]
        assert row["est_error"] == pytest.approx(np.mean(row["est_error_layers"]), abs=1e-12)  # linear in mean k
    assert any(e != 0 for errs in conf["est_error_layers"] for e in errs[1:])  # later layers do differ here


def test_a_hybrid_model_with_512_experts_evaluates_with_its_routing_changed():
    """Qwen3-Next (512 experts, top-10, linear-attention layers):
    perplexity is measured with the routing changed, the routed-expert reduction is that of the kept pairs, and
    the whole-forward share counts the gated DeltaNet layer's mixer (`compute.LinearMixer`) with the rest."""
    try:
        m = tiny_random("qwen3_next")
    except ValueError:
        pytest.skip("this transformers has no Qwen3-Next")
    for layer in moe_layers(m):
        torch.nn.init.normal_(layer.block.gate.weight, std=0.5)
    ids = torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(1))
    base = evaluate(m, None, ids, context=32, stride=32, progress=False)
    native = evaluate(m, TopK(10), ids, context=32, stride=32, progress=False)
    assert native.summary["ppl"] == pytest.approx(base.summary["ppl"], rel=1e-5)
    half = evaluate(m, TopK(5), ids, context=32, stride=32, progress=False, baseline_ppl=base.summary["ppl"])
    assert half.summary["expert_reduction"] == pytest.approx(0.5) and half.summary["mean_k"] == 5.0
    assert half.summary["ppl"] != pytest.approx(base.summary["ppl"], rel=1e-6)
    assert 0 < half.summary["forward_reduction"] < 0.5  # the mixers, the shared expert and the head are not skipped


def test_an_empty_policy_dict_is_refused_before_the_run(model, ids):
    forwards = []
    handle = model.register_forward_pre_hook(lambda *a: forwards.append(1))
    try:
        with pytest.raises(ValueError, match=r"policy=\{\}: a dict needs at least one"):
            evaluate(model, {}, ids, context=CTX, progress=False)
    finally:
        handle.remove()
    assert forwards == []


@pytest.mark.parametrize("bad", [-1000, 0, 0.4, float("nan"), float("inf"), "64", True])
def test_bad_attended_is_named(model, ids, bad):
    sample = router_sample(model, ids[:128], context=CTX, progress=False)
    with pytest.raises(ValueError, match=r"attended=.*: must be a finite number >= 1"):
        sample.estimate(TopK(1), attended=bad)
    assert sample.estimate(TopK(1), attended=np.float64(32.0)) == sample.estimate(TopK(1), attended=32)


def test_router_sample_keeps_expert_ids_above_the_int16_range():
    """E = 33000: the recorded ids do not wrap around, and expert_load counts the pairs on the experts they name."""
    m = tiny_random("mixtral", num_hidden_layers=1, num_local_experts=33000, intermediate_size=4, hidden_size=16,
                    num_attention_heads=2, num_key_value_heads=1)
    (layer,) = moe_layers(m)
    with torch.no_grad():
        layer.block.gate.weight[:32768] = 0  # only experts 32768..32999 have non-zero logits: the top ones
    sample = router_sample(m, torch.arange(8), context=8, progress=False)
    top = sample.top_ids[0]
    assert top.dtype == torch.int32 and int(top[:, 0].min()) >= 32768
    load = sample.expert_load()
    assert load.sum() == 8 * 2 and load[0, :32768].sum() == 0


def test_an_adaptive_policy_that_changes_nothing_is_reported(ids, caplog):
    """An untrained model's routers are flat (entropy near log E): thresholds below every entropy keep k_max for
    every token, and evaluate says so instead of returning a silent no-op; a policy that changes k says nothing."""
    flat = tiny_random("mixtral", num_hidden_layers=2)  # router weights at init: std 0.02, entropy ~ log 8
    with caplog.at_level("WARNING", logger="moelab.evaluate"):
        ev = evaluate(flat, EntropyAdaptiveK((1, 2), (1.0,)), ids[:128], context=CTX, stride=CTX, progress=False)
    assert ev.summary["mean_k"] == 2
    msgs = [r.getMessage() for r in caplog.records if "changed nothing" in r.getMessage()]
    assert len(msgs) == 1 and "in the 2 layer(s)" in msgs[0]
    pct = int(msgs[0].split("nats, ")[1].split("%")[0])
    assert 95 <= pct <= 100 and "look flat" in msgs[0]  # the flat router's median entropy against log 8
    caplog.clear()
    with caplog.at_level("WARNING", logger="moelab.evaluate"):
        ev = evaluate(flat, EntropyAdaptiveK((1, 2), (3.0,)), ids[:128], context=CTX, stride=CTX, progress=False)
        evaluate(flat, TopK(1), ids[:128], context=CTX, stride=CTX, progress=False)  # fixed k: nothing to warn of
    assert ev.summary["mean_k"] == 1  # a threshold above log 8: every token drops to k = 1
    with caplog.at_level("WARNING", logger="moelab.evaluate"):  # k_max everywhere on purpose: asked not to warn
        ev = evaluate(flat, EntropyAdaptiveK((1, 2), (1.0,)), ids[:128], context=CTX, stride=CTX, progress=False,
                      warn_unchanged=False)
    assert ev.summary["mean_k"] == 2
    assert not [r for r in caplog.records if "changed nothing" in r.getMessage()]


def test_the_summary_names_the_weights_dtype(model, ids, base):
    """A bf16 perplexity is not an fp32 one (the patch alone moves it by ~1e-4): the summary says which ran."""
    assert base.summary["dtype"] == "float32"
    m16 = tiny_random("mixtral", num_hidden_layers=2).to(torch.bfloat16)
    ev = evaluate(m16, TopK(1), ids[:128], context=CTX, stride=CTX, progress=False)
    assert ev.summary["dtype"] == "bfloat16" and np.isfinite(ev.summary["ppl"]) and ev.summary["mean_k"] == 1


# ---- sliding-window perplexity ----

@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    cfg = MixtralConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )
    return MixtralForCausalLM(cfg).eval()


def reference_nll(lm, ids, context, stride):
    """Token by token: log p(ids[j] | the window that scores j), from full-window logits."""
    total, n = 0.0, 0
    for begin, end, scored in windows(len(ids), context, stride):
        with torch.no_grad():
            logp = torch.log_softmax(lm(input_ids=ids[None, begin:end]).logits[0].float(), -1)
        for j in range(end - scored, end):
            total -= float(logp[j - begin - 1, ids[j]])
            n += 1
    return total / n, n


def test_windows_cover_every_token_once():
    for n, c, s in [(10, 4, 2), (10, 4, 4), (3, 4, 2), (100, 16, 5), (17, 17, 17)]:
        scored = set()
        for begin, end, k in windows(n, c, s):
            assert end - begin <= c and k <= end - begin - 1
            new = set(range(end - k, end))
            assert not (new & scored)
            scored |= new
        # stride < context: every token but the first gets a prediction
        if s < c:
            assert scored == set(range(1, n))
        else:  # no overlap: each window's first token has no prediction inside it
            starts = set(range(0, n, s))
            assert scored == set(range(n)) - starts


def test_matches_token_by_token_reference(lm):
    ids = torch.randint(0, 97, (80,), generator=torch.Generator().manual_seed(1))
    out = perplexity(lm, None, ids, context=32, stride=8, progress=False)
    ref, n = reference_nll(lm, ids, 32, 8)
    assert out["scored_tokens"] == n == 79
    assert out["nll"] == pytest.approx(ref, rel=1e-5)
    assert out["ppl"] == pytest.approx(math.exp(ref), rel=1e-5)


class Bigram(torch.nn.Module):
    """A causal LM whose logits at a position depend on that position's token alone: each token's loss is the same
    in any batch, so a reference can sum exactly the losses perplexity sums."""

    def __init__(self, vocab: int):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, vocab)
        torch.nn.init.normal_(self.emb.weight, std=3.0, generator=torch.Generator().manual_seed(0))

    def get_input_embeddings(self):
        return self.emb

    def forward(self, input_ids, **kwargs):
        return SimpleNamespace(logits=self.emb(input_ids))


def test_losses_are_summed_in_float64():
    """40k fp32 losses summed in fp32 round the mean by ~1e-8; the fp64 sum agrees with the exact one to ~1e-15."""
    m = Bigram(500)
    ids = torch.randint(0, 500, (40_001,), generator=torch.Generator().manual_seed(1))
    out = perplexity(m, None, ids, context=2000, stride=2000, batch_size=20, progress=False)
    with torch.no_grad():
        loss_T = F.cross_entropy(m.emb.weight[ids[:-1]].float(), ids[1:], reduction="none").double()
    scored_T = torch.arange(1, ids.numel()) % 2000 != 0  # no prediction for a window's first token
    assert out["scored_tokens"] == int(scored_T.sum()) == 39_980
    assert out["nll"] == pytest.approx(float(loss_T[scored_T].sum() / scored_T.sum()), rel=1e-13, abs=0)


def test_batch_size_does_not_change_result(lm):
    ids = torch.randint(0, 97, (100,), generator=torch.Generator().manual_seed(2))
    a = perplexity(lm, None, ids, context=24, stride=6, batch_size=1, progress=False)
    b = perplexity(lm, None, ids, context=24, stride=6, batch_size=5, progress=False)
    assert a["scored_tokens"] == b["scored_tokens"]
    assert a["nll"] == pytest.approx(b["nll"], rel=1e-5)


def test_context_clipped_to_model_and_max_tokens(lm):
    ids = torch.randint(0, 97, (300,), generator=torch.Generator().manual_seed(3))
    out = perplexity(lm, None, ids, context=2048, stride=512, max_tokens=200, progress=False)
    assert out["context"] == 64 and out["stride"] == 64
    assert out["windows"] == 4 and out["scored_tokens"] == 200 - 4  # no overlap: each window's first unscored
    # one window covering everything equals the model's own mean loss
    one = perplexity(lm, None, ids[:50], context=64, stride=16, progress=False)
    with torch.no_grad():
        loss = lm(input_ids=ids[None, :50], labels=ids[None, :50]).loss
    assert one["scored_tokens"] == 49 and one["nll"] == pytest.approx(float(loss), rel=1e-5)


def test_bad_input_raises():
    with pytest.raises(ValueError, match="tokenizer=None"):
        token_ids(None, "some text")
    with pytest.raises(ValueError, match="stride=0"):
        windows(10, 4, 0)
    with pytest.raises(ValueError, match=r"stride=1024: must be in \[1, context=512\]"):
        perplexity(None, None, torch.arange(10), context=512, stride=1024)
    with pytest.raises(ValueError, match="must be integers"):
        token_ids(None, torch.zeros(5))
    assert token_ids(None, []).dtype == torch.long  # empty: no dtype to judge; the callers name the count
    with pytest.raises(ValueError, match="0 tokens: need at least 2"):
        perplexity(None, None, [])


def test_ids_outside_the_vocabulary_and_bad_context_are_named(lm):
    """An id the embedding cannot look up is named with its position (not an IndexError or a device assert)."""
    ids = torch.arange(20) % 97
    ids[7] = 500
    with pytest.raises(ValueError, match=r"token id 500 at position 7: must be in \[0, vocab_size=97\)"):
        perplexity(lm, None, ids, context=16, stride=8, progress=False)
    with pytest.raises(ValueError, match=r"token id -1 at position 0"):
        perplexity(lm, None, torch.tensor([-1, 2, 3]), context=16, stride=8, progress=False)
    with pytest.raises(ValueError, match=r"context=0: must be an int >= 2"):
        perplexity(lm, None, torch.arange(10), context=0, stride=1, progress=False)
    with pytest.raises(ValueError, match=r"context=16.0: must be an int"):
        perplexity(lm, None, torch.arange(10), context=16.0, stride=8, progress=False)


def test_ids_past_max_tokens_are_not_checked(lm):
    """Only what the model reads must be in the vocabulary: max_tokens cuts the stream first."""
    ids = torch.arange(40) % 97
    ids[30] = 500
    r = perplexity(lm, None, ids, context=16, stride=8, max_tokens=24, progress=False)
    assert r == perplexity(lm, None, ids[:24], context=16, stride=8, progress=False)
    assert r["scored_tokens"] == 23 and math.isfinite(r["ppl"])
    for bad in (1, 0, True, 24.0):
        with pytest.raises(ValueError, match=rf"max_tokens={bad!r}: must be an int >= 2 or None"):
            perplexity(lm, None, ids, context=16, stride=8, max_tokens=bad, progress=False)
    assert perplexity(lm, None, ids, context=16, stride=8, max_tokens=2, progress=False)["scored_tokens"] == 1


def test_non_finite_logits_raise_at_the_first_bad_window():
    """A NaN weight fails the window that reads it, as the patched path's router check does, and the later windows
    are not run; the message names the logit and the window."""
    net = tiny_random("mixtral", tie_word_embeddings=False)
    with torch.no_grad():
        net.model.embed_tokens.weight[5] = float("nan")
    ids = torch.arange(10, 42)
    ids[20] = 5
    forwards = []
    net.register_forward_hook(lambda *a: forwards.append(1))
    with pytest.raises(ValueError, match=r"logits\[0, \d+, \d+\]=nan in the window ids\[16:24\]: logits must be fin"):
        perplexity(net, None, ids, context=8, stride=8, progress=False)
    assert len(forwards) == 3  # of 4 windows
    forwards.clear()  # the 4 windows in one batch: the message names the bad row's window, not the batch's first
    with pytest.raises(ValueError, match=r"logits\[2, \d+, \d+\]=nan in the window ids\[16:24\]: logits must be"):
        perplexity(net, None, ids, context=8, stride=8, batch_size=4, progress=False)
    assert len(forwards) == 1
    assert math.isfinite(perplexity(net, None, ids[:16], context=8, stride=8, progress=False)["ppl"])


def test_ids_of_a_wrong_type_and_numpy_ints(lm):
    with pytest.raises(ValueError, match=r"token ids of dtype torch.complex64: must be integers"):
        token_ids(None, torch.ones(4, dtype=torch.complex64))
    for bad in (None, ["a", "b"]):
        with pytest.raises(TypeError, match=rf"text_or_ids={re.escape(repr(bad))}: must be a str \(with a tokenizer\)"):
            perplexity(lm, None, bad, progress=False)
    ids = torch.arange(40) % 97
    want = perplexity(lm, None, ids, context=16, stride=8, max_tokens=30, batch_size=2, progress=False)
    got = perplexity(lm, None, ids, context=np.int64(16), stride=np.int32(8), max_tokens=np.int64(30),
                     batch_size=np.int64(2), progress=False)
    assert got == want and type(got["context"]) is int


def test_evaluate_many_is_evaluate_in_one_pass_with_kl_against_the_unchanged_model(model, ids):
    """Several policies in one pass give each one's own evaluation; with kl each batch runs unchanged once (the
    unchanged policy reuses it), and KL and top-1 agreement are against that forward."""
    forwards = []
    handle = model.register_forward_pre_hook(lambda *a: forwards.append(1))
    try:
        evs = evaluate_many(model, [None, TopK(2), TopK(1)], ids, context=CTX, stride=CTX, batch_size=2,
                            progress=False)
    finally:
        handle.remove()
    assert len(forwards) == 3 * 3  # 5 windows in batches of 2, 2, 1: three runs each (not four)
    alone = evaluate(model, TopK(1), ids, context=CTX, stride=CTX, batch_size=2, progress=False)
    assert evs[2].summary["ppl"] == alone.summary["ppl"] and evs[2].window_nll == alone.window_nll
    assert evs[2].summary["mean_k"] == alone.summary["mean_k"] == 1 and "kl" not in alone.summary
    none, native, one = (ev.summary for ev in evs)
    assert none["kl"] == 0 and none["top1_agree"] == 1 and native["kl"] < 1e-9 and native["top1_agree"] == 1
    assert one["kl"] > 1e-6 and one["top1_agree"] <= 1
    # KL and agreement by hand on the whole text, window by window
    kl, agree = 0.0, 0
    for b, e, scored in windows(len(ids), CTX, CTX):
        with torch.no_grad():
            ref = F.log_softmax(model(input_ids=ids[None, b:e]).logits[0, -scored - 1 : -1].float(), -1)
            with patched(model, TopK(1)):
                got = F.log_softmax(model(input_ids=ids[None, b:e]).logits[0, -scored - 1 : -1].float(), -1)
        kl += float((ref.exp() * (ref - got)).sum())
        agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
    assert one["kl"] == pytest.approx(kl / one["scored_tokens"], rel=1e-3)  # fp32 sums of tiny terms
    assert one["top1_agree"] == agree / one["scored_tokens"]
    assert sum(evs[2].window_nll) == pytest.approx(one["nll"] * one["scored_tokens"], rel=1e-12)
    assert evs[2].window_tokens == [w[2] for w in windows(len(ids), CTX, CTX)]


def test_paired_bootstrap_known_answers():
    """Identical policies give an interval holding 0; a clearly worse one (TopK 1 on the top-8 tiny-olmoe) one
    that excludes it; a constant shift per window gives exactly that shift."""
    from moelab.data import eval_text
    from moelab.models import load

    net, tok = load("tiny-olmoe")
    text_ids = torch.tensor(tok(eval_text()[:20000], add_special_tokens=False)["input_ids"][:2048])
    same_a, same_b, worse = evaluate_many(net, [TopK(8), TopK(8), TopK(1)], text_ids, context=128, stride=128,
                                          kl=False, progress=False)
    ci = ppl_change_ci(same_a.window_nll, same_b.window_nll, same_a.window_tokens, resamples=500, seed=1)
    assert ci["ci_lo"] <= 0 <= ci["ci_hi"] and ci["windows"] == 16 and ci["resamples"] == 500
    ci = ppl_change_ci(worse.window_nll, same_a.window_nll, same_a.window_tokens, resamples=500, seed=1)
    assert ci["ci_lo"] > 0 and ci["ci_lo"] <= ci["ppl_change"] <= ci["ci_hi"]
    assert ci["ppl_change"] == pytest.approx(worse.summary["ppl"] / same_a.summary["ppl"] - 1, rel=1e-9)
    tokens = [100] * 50
    b = np.random.default_rng(0).normal(500, 30, 50)
    ci = ppl_change_ci(b + 1.0, b, tokens, resamples=200)  # +0.01 nats per token in every window
    assert ci["ci_lo"] == pytest.approx(math.exp(0.01) - 1, rel=1e-9) == ci["ci_hi"]


def test_bootstrap_ppl_draws_the_same_windows_for_every_row_from_its_seed():
    nll = np.random.default_rng(1).normal(300, 20, (3, 40))
    a = bootstrap_ppl(nll, [64] * 40, resamples=100, seed=3)
    assert a.shape == (100, 3) and np.array_equal(a, bootstrap_ppl(nll, [64] * 40, resamples=100, seed=3))
    assert not np.array_equal(a, bootstrap_ppl(nll, [64] * 40, resamples=100, seed=4))
    twice = bootstrap_ppl(np.stack([nll[0], nll[0]]), [64] * 40, resamples=100, seed=3)
    assert np.array_equal(twice[:, 0], twice[:, 1]) and np.allclose(twice[:, 0], a[:, 0])
    with pytest.raises(ValueError, match=r"window_nll of shape \(3, 40\), window_tokens of shape \(39,\)"):
        bootstrap_ppl(nll, [64] * 39)
    with pytest.raises(ValueError, match=r"resamples=0: must be an int >= 1"):
        bootstrap_ppl(nll, [64] * 40, resamples=0)
