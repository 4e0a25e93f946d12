"""Evaluation: measured perplexity and compute with routing changed; estimates from recorded routers."""

import numpy as np
import pytest
import torch

from moelab.compute import expert_reduction
from moelab.evaluate import confirm_estimates, estimate, evaluate, policy_label, router_sample
from moelab.hf import moe_layers, patched, record_router
from moelab.models import tiny_random
from moelab.perplexity import perplexity
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
    return torch.randint(0, 256, (640,), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def base(model, ids):
    return evaluate(model, None, ids, context=CTX, stride=CTX // 2, progress=False)


def test_baseline_is_plain_perplexity(model, ids, base):
    ref = perplexity(model, None, ids, context=CTX, stride=CTX // 2, progress=False)
    assert base.summary["ppl"] == pytest.approx(ref["ppl"], rel=1e-6)  # batch 8 vs 1: float noise
    assert base.summary["scored_tokens"] == ref["scored_tokens"] == 639
    assert base.summary["mean_k"] == 2 and base.summary["expert_reduction"] == 0
    assert base.summary["forward_reduction"] == pytest.approx(0.0)
    assert base.summary["routed_tokens"] == ref["forwarded_tokens"]
    assert base.summary["compute_frac"] == 1.0  # all native work kept
    assert set(base.layers["layer"]) == {0, 1, 2}
    q = base.layers[["ent_q05", "ent_q50", "ent_q95"]].to_numpy()
    assert (q[:, 0] <= q[:, 1]).all() and (q[:, 1] <= q[:, 2]).all() and q.max() <= torch.log(torch.tensor(8.0))


def test_native_topk_patched_equals_baseline(model, ids, base):
    ev = evaluate(model, TopK(2), ids, context=CTX, stride=CTX // 2, baseline_ppl=base.summary["ppl"], progress=False)
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
    est = estimate(router_sample(model, short, context=CTX, progress=False), TopK(1))
    assert est["forward_reduction"] == pytest.approx(asked["forward_reduction"], rel=1e-12)
    res = perplexity(model, None, ids[:150], context=CTX, stride=CTX, progress=False)  # windows of 64, 64, 22
    assert (res["forwarded_tokens"], res["longest_window"]) == (150, 64)
    assert res["attended_mean"] == pytest.approx((2 * 64 * 65 / 2 + 22 * 23 / 2) / 150)


def test_estimates(model, ids):
    sample = router_sample(model, ids, context=CTX, progress=False)
    assert sample.num_tokens == 640 and sample.num_layers == 3 and sample.unused_tokens == 0
    short = router_sample(model, ids[:600], context=CTX, progress=False)  # 9 whole chunks and 24 tokens
    assert (short.num_tokens, short.unused_tokens) == (576, 24)
    assert estimate(sample, TopK(1))["mean_k"] == 1.0
    load = sample.expert_load()
    assert load.shape == (3, 8) and (load.sum(1) == 640 * 2).all()
    med = float(sample.entropy[0].median())
    pol = EntropyAdaptiveK((1, 2, 4), (med - 0.1, med + 0.1))
    est = estimate(sample, pol)
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
        assert estimate(sample, p)["mean_k_layers"] == [float(k.float().mean()) for k in want]
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
        estimated = estimate(sample, p)["mean_k_layers"]
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
    ids = torch.randint(0, 256, (96,), generator=torch.Generator().manual_seed(1))
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


def test_numpy_baseline_ppl_is_accepted(model, ids, base):
    ppl = base.summary["ppl"]
    ev = evaluate(model, TopK(2), ids, context=CTX, stride=CTX // 2, baseline_ppl=np.float32(ppl), progress=False)
    assert ev.summary["ppl_change"] == pytest.approx(0.0, abs=1e-5)


@pytest.mark.parametrize("bad", [-1000, 0, 0.4, float("nan"), float("inf"), "64", True])
def test_bad_attended_is_named(model, ids, bad):
    sample = router_sample(model, ids[:128], context=CTX, progress=False)
    with pytest.raises(ValueError, match=r"attended=.*: must be a finite number >= 1"):
        estimate(sample, TopK(1), attended=bad)
    assert estimate(sample, TopK(1), attended=np.float64(32.0)) == estimate(sample, TopK(1), attended=32)


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
