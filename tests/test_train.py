"""The training loop on a micro model on the CPU: it learns, resumes exactly, and logs the run."""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moelab import models
from moelab.train import TrainConfig, train

pytestmark = pytest.mark.skipif(not (models.tokenizer_dir() / "tokenizer.json").exists(),
                                reason="the shared tokenizer data/models/tokenizer is missing")

MICRO = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
             intermediate_size=16, num_experts=8, num_experts_per_tok=2)


def _cfg(out, **kw):
    base = dict(model="tiny-olmoe", out=str(out), overrides=MICRO, seq_len=32, batch_size=4, lr=3e-3,
                warmup_steps=2, max_steps=8, eval_every=4, eval_tokens=700, train_tokens=4000, log_every=1,
                device="cpu")
    base.update(kw)
    return TrainConfig(**base)


def test_train_resume_and_log(tmp_path):
    full = train(_cfg(tmp_path / "full"))
    # the same run killed after 3 steps and resumed must end with the same weights
    part = train(_cfg(tmp_path / "split", stop_after=3))
    assert part["steps"] == 3 and part["stop_reason"] == "stop_after=3"
    resumed = train(_cfg(tmp_path / "split"))
    assert resumed["steps"] == 8 and resumed["tokens_seen"] == full["tokens_seen"] == 8 * 4 * 32
    w_full = load_file(tmp_path / "full" / ".resume" / "model.safetensors")
    w_split = load_file(tmp_path / "split" / ".resume" / "model.safetensors")
    assert w_full.keys() == w_split.keys()
    for k in w_full:
        torch.testing.assert_close(w_full[k], w_split[k], rtol=1e-5, atol=1e-6, msg=k)
    # a changed config does not silently resume
    with pytest.raises(ValueError, match="different config"):
        train(_cfg(tmp_path / "split", lr=1e-3))

    log = json.loads((tmp_path / "split" / "train_log.json").read_text())
    for key in ("config", "tokens_seen", "loss_curve", "val_curve", "wall_time_s", "device", "machine", "commit"):
        assert key in log, key
    assert log["machine"]["torch"] == torch.__version__
    assert [p["step"] for p in log["loss_curve"]] == list(range(1, 9))
    assert all(p["aux_loss"] > 0 for p in log["loss_curve"])  # the router balancing loss was on
    losses = [p["loss"] for p in log["loss_curve"]]
    assert losses[-1] < losses[0]  # it learns
    assert log["best_val_loss"] == min(v["val_loss"] for v in log["val_curve"])

    # the best checkpoint is a loadable bf16 model with the tokenizer beside it
    model, tok = models.load(tmp_path / "split")
    assert model.dtype == torch.float32 and models.moe_info(model)["num_experts"] == 8
    stored = load_file(tmp_path / "split" / "model.safetensors")
    assert all(v.dtype == torch.bfloat16 for v in stored.values())
    assert tok.decode(tok("the sea")["input_ids"]) == "the sea"


@pytest.mark.parametrize("cut", [".resume.old", ".resume"])
def test_a_kill_inside_the_resume_save_loses_at_most_that_save(tmp_path, monkeypatch, caplog, cut):
    """Killed at either rename of the swap (.resume -> .resume.old, .resume.tmp -> .resume), the next run resumes
    from a complete state (the one before, or the one just written) and ends with the uninterrupted run's weights."""
    full = train(_cfg(tmp_path / "full"))
    train(_cfg(tmp_path / "cut", stop_after=3))
    rename = Path.rename

    def killed(self, target):
        if Path(target).name == cut:
            raise KeyboardInterrupt("killed")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", killed)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(tmp_path / "cut"))
    monkeypatch.setattr(Path, "rename", rename)
    with caplog.at_level("INFO", logger="moelab.train"):
        resumed = train(_cfg(tmp_path / "cut"))
    assert f"resuming {tmp_path / 'cut'} at step {3 if cut == '.resume.old' else 4}" in caplog.text
    assert resumed["steps"] == 8 and resumed["tokens_seen"] == full["tokens_seen"]
    assert not (tmp_path / "cut" / ".resume.tmp").exists() and not (tmp_path / "cut" / ".resume.old").exists()
    w_full = load_file(tmp_path / "full" / ".resume" / "model.safetensors")
    w_cut = load_file(tmp_path / "cut" / ".resume" / "model.safetensors")
    for k in w_full:
        torch.testing.assert_close(w_full[k], w_cut[k], rtol=1e-5, atol=1e-6, msg=k)


def test_bad_config_raises(tmp_path):
    with pytest.raises(ValueError, match="seq_len=4"):
        train(_cfg(tmp_path / "x", seq_len=4))
    with pytest.raises(ValueError, match="amp='fp16'"):
        train(_cfg(tmp_path / "x", amp="fp16"))
    for name in ("eval_every", "log_every"):
        with pytest.raises(ValueError, match=f"{name}=0: must be an int >= 1"):
            train(_cfg(tmp_path / "x", **{name: 0}))
    with pytest.raises(ValueError, match="eval_tokens=8 gives .* held-out tokens, fewer than one window"):
        train(_cfg(tmp_path / "x", eval_tokens=8))



def test_bad_values_raise_before_any_work(tmp_path):
    """Each bad value is refused before the output folder, the data or the model is made."""
    from moelab.train import main

    bad = [("grad_clip", -1.0), ("grad_clip", 0.0), ("lr", 0.0), ("lr", float("nan")), ("lr", float("inf")),
           ("min_lr_frac", 1.5), ("warmup_steps", -1), ("warmup_steps", 2.5), ("train_tokens", -5),
           ("stop_after", -1), ("time_budget_s", -1.0), ("eval_every", True), ("model", "nosuch"),
           ("overrides", [1]), ("min_lr_frac", -0.1), ("time_budget_s", float("nan")), ("eval_tokens", 0),
           ("eval_tokens", 2.5)]
    if not torch.cuda.is_available():
        bad.append(("device", "cuda"))
    for name, v in bad:
        out = tmp_path / name
        with pytest.raises(ValueError, match=re.escape(f"{name}={v!r}")):
            train(_cfg(out, **{name: v}))
        assert not out.exists(), name
    with pytest.raises(ValueError, match="not an embedded model .*tiny-olmoe.* or a family .*olmoe"):
        train(_cfg("", model="nosuch"))
    assert not (models.models_dir() / "nosuch").exists()
    with pytest.raises(ValueError, match=re.escape("overrides=[1]: must be a dict")):
        main(["--overrides", "[1]", "--out", str(tmp_path / "cli")])
    assert not (tmp_path / "cli").exists()
    with pytest.raises(TypeError, match="num_expert=4: not a .*Config field"):  # an override's name, before the data
        train(_cfg(tmp_path / "ov", overrides={"num_expert": 4}))
    assert not (tmp_path / "ov").exists()


def test_a_family_name_trains_with_the_tokenizers_vocabulary(tmp_path):
    """model='olmoe' (a family's micro config) gets the shared tokenizer's vocabulary, not 256 ids."""
    train(_cfg(tmp_path / "fam", model="olmoe", overrides={}, max_steps=2, eval_every=2))
    cfg = json.loads((tmp_path / "fam" / "config.json").read_text())
    assert cfg["vocab_size"] >= 8000


def test_card_scores_the_unseen_heldout_slices_and_flags_seen_validation_text(tmp_path):
    """The card's held-out losses are on exactly heldout_texts() (text never trained on) and agree with
    moelab.perplexity on the same windows; a log whose validation used slices that repeat training text
    says so in the card."""
    import math

    from moelab.data import heldout_texts
    from moelab.evaluate import perplexity
    from moelab.train import _stream, evaluate, write_card

    out = tmp_path / "m"
    log = train(_cfg(out, max_steps=2, eval_every=2))
    held = heldout_texts()
    assert log["validation_texts"] == list(held)
    write_card(out, eval_tokens=512)
    ev = json.loads((out / "eval.json").read_text())
    assert list(ev["heldout_loss"]) == list(held) == ev["router"]["texts"]
    from moelab.results import command_line
    assert ev["command"] == command_line()  # the card records the command line that made it
    model, tok = models.load(out)
    L = min(512, model.config.max_position_embeddings)
    for name, loss in ev["heldout_loss"].items():
        ids = _stream(tok, {name: held[name]}, ev["heldout_tokens_each"])
        ids = ids[: (ids.numel() // L) * L]
        ref = perplexity(model, tok, ids, context=L, stride=L, progress=False)
        assert math.isclose(loss, ref["nll"], rel_tol=1e-5), (name, loss, ref["nll"])
    assert ev["heldout_scored_tokens"] == {
        name: (_stream(tok, {name: held[name]}, ev["heldout_tokens_each"]).numel() // L) * (L - 1) for name in held}
    card = (out / "README.md").read_text()
    assert all(f"| {name} | {ev['heldout_scored_tokens'][name]:,} |" in card for name in held)
    assert "repeat training text" not in card
    assert "unchanged model scores" not in card  # the committed full-test runs are of the embedded models only
    with pytest.raises(ValueError, match=r"stats_tokens=1000: must be an int >= "):
        evaluate(out, eval_tokens=512, stats_tokens=1000)

    log["validation_texts"] = ["tinyshakespeare", "olmoe_arxiv"]  # as the first trained models' logs say
    (out / "train_log.json").write_text(json.dumps(log))
    # a checkpoint folder named like an embedded model is not that model: no line from its committed runs
    named = out.rename(tmp_path / "tiny-olmoe")
    write_card(named, reuse=True)
    card = (named / "README.md").read_text()
    assert "(1 of which repeat training text" in card and "unchanged model scores" not in card


def test_train_tokens_are_the_first_of_the_whole_stream():
    """train_tokens=N takes the first N tokens of the joined training texts, continuing into the next text
    when the first is shorter (it used to stop at the end of the first text)."""
    from transformers import AutoTokenizer

    from moelab.train import _train_ids

    tok = AutoTokenizer.from_pretrained(models.tokenizer_dir())
    texts = {"a": "To be, or not to be, that is the question.", "b": "The quick brown fox jumps. " * 40}
    full = _train_ids(tok, texts)
    n_a = len(tok(texts["a"], add_special_tokens=False)["input_ids"]) + 1  # with its EOS
    assert full.numel() > n_a + 30
    for n in (5, n_a, n_a + 30):
        assert torch.equal(_train_ids(tok, texts, n), full[:n])


def test_per_layer_balance_loss_sees_what_the_pooled_loss_misses():
    """transformers' balancing loss pools the expert loads over layers: two layers each sending every token to
    two of four experts (different ones) sit at its minimum k. Taken per layer the same routers score 2k; with
    one layer both losses agree."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from moelab.train import balance_loss

    T, E, k = 64, 4, 1
    big = torch.full((T, E), -20.0)
    l0, l1 = big.clone(), big.clone()
    l0[: T // 2, 0] = l0[T // 2 :, 1] = 20.0  # layer 0: experts 0 and 1, half the tokens each
    l1[: T // 2, 2] = l1[T // 2 :, 3] = 20.0  # layer 1: experts 2 and 3
    pooled = float(load_balancing_loss_func((l0, l1), E, k))
    assert pooled == pytest.approx(k, abs=1e-6)  # looks perfectly balanced
    assert float(balance_loss((l0, l1), E, k)) == pytest.approx(2 * k, abs=1e-6)
    torch.manual_seed(0)
    r = torch.randn(T, E)
    assert float(balance_loss((r,), E, 2)) == pytest.approx(float(load_balancing_loss_func((r,), E, 2)), rel=1e-5)
    uniform = torch.zeros(T, E)
    uniform[torch.arange(T), torch.arange(T) % E] = 1e-3  # each expert top-1 for a quarter of the tokens
    assert float(balance_loss((uniform, uniform), E, 1)) == pytest.approx(1.0, abs=1e-3)


def test_per_layer_balance_trains(tmp_path):
    """balance='per-layer' swaps only the router loss: the first step's next-token loss is the model's own."""
    log = train(_cfg(tmp_path / "pl", balance="per-layer", max_steps=4, eval_every=4))
    assert log["config"]["balance"] == "per-layer"
    auxes = [p["aux_loss"] for p in log["loss_curve"]]
    assert all(2 - 1e-3 < a < 8 for a in auxes)  # k = 2 when every layer is balanced, E = 8 when collapsed
    losses = [p["loss"] for p in log["loss_curve"]]
    assert losses[-1] < losses[0]
    ref = train(_cfg(tmp_path / "ref", max_steps=1, eval_every=1))
    assert losses[0] == pytest.approx(ref["loss_curve"][0]["loss"], rel=1e-5)
    with pytest.raises(ValueError, match="balance='pooled': must be 'model' or 'per-layer'"):
        train(_cfg(tmp_path / "bad", balance="pooled"))


@pytest.mark.parametrize("family", sorted(models.FAMILIES))
def test_per_layer_forward_skips_the_pooled_loss(family, monkeypatch):
    """The per-layer mode's forward gives the model's own logits and router logits, and never calls the
    family's pooled balancing loss (it would be computed for nothing)."""
    import sys

    import transformers

    from moelab.train import _logits_and_router_logits

    if not hasattr(transformers, models.FAMILIES[family][1]):
        pytest.skip(f"this transformers has no {family}")
    m = models.tiny_random(family, seed=2)
    x = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = m(input_ids=x, use_cache=False, output_router_logits=True)
        modeling = sys.modules[type(m).__module__]
        assert hasattr(modeling, "load_balancing_loss_func")  # what the causal-LM forward would call

        def pooled(*a, **kw):
            raise AssertionError("the pooled balancing loss was computed")

        monkeypatch.setattr(modeling, "load_balancing_loss_func", pooled)
        logits, router_logits = _logits_and_router_logits(m, x)
    torch.testing.assert_close(logits, ref.logits, rtol=0, atol=0)
    assert len(router_logits) == len(ref.router_logits)
    for got, want in zip(router_logits, ref.router_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
