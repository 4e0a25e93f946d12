"""tools/train.py on a micro model on the CPU: it learns, resumes exactly from a state that loads with
weights_only=True, honours the seed and the shipped recipe, and logs the run; tools/tokenizer.py's unigram floor."""

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moelab import models

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import train as T  # noqa: E402  (tools/train.py)

pytestmark = pytest.mark.skipif(not (models.tokenizer_dir() / "tokenizer.json").exists(),
                                reason="the shared tokenizer data/models/tokenizer is missing")

MICRO = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
             intermediate_size=16, num_experts=8, num_experts_per_tok=2)


def _cfg(out, **kw):
    base = dict(out=str(out), overrides=MICRO, seq_len=32, batch_size=4, lr=3e-3, warmup_steps=2, max_steps=8,
                eval_every=4, eval_tokens=700, train_tokens=4000, log_every=1, device="cpu")
    base.update(kw)
    return T.recipe(base.pop("model", "tiny-olmoe"), **base)


def _weights(folder: Path) -> dict:
    return load_file(folder / ".resume" / "model.safetensors")


def _same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """One uninterrupted 8-step run (log, final weights, folder): the reference the resumed runs must end on."""
    out = tmp_path_factory.mktemp("full")
    return T.train(_cfg(out)), _weights(out), out


@pytest.fixture(scope="module")
def at3(tmp_path_factory):
    """The same run stopped after 3 steps (a folder to copy and resume)."""
    out = tmp_path_factory.mktemp("at3")
    part = T.train(_cfg(out, stop_after=3))
    assert part["steps"] == 3 and part["stop_reason"] == "stop_after=3"
    return out


def _copy(folder: Path, to: Path) -> Path:
    return Path(shutil.copytree(folder, to))


def test_train_resume_and_log(tmp_path, full, at3):
    log_full, w_full, _ = full
    run = _copy(at3, tmp_path / "run")  # the same run killed after 3 steps and resumed
    # the resume state is tensors and plain values only
    state = torch.load(run / ".resume" / "optim.pt", weights_only=True)
    assert set(state) == {"optimizer", "torch_rng", "cuda_rng"} and state["torch_rng"].dtype == torch.uint8
    resumed = T.train(_cfg(run))
    assert resumed["steps"] == 8 and resumed["tokens_seen"] == log_full["tokens_seen"] == 8 * 4 * 32
    _same_weights(w_full, _weights(run))
    with pytest.raises(ValueError, match="different config"):  # a changed config does not silently resume
        T.train(_cfg(run, lr=1e-3))

    log = json.loads((run / "train_log.json").read_text())
    for key in ("config", "tokens_seen", "loss_curve", "val_curve", "wall_time_s", "device", "machine", "commit"):
        assert key in log, key
    assert log["machine"]["torch"] == torch.__version__
    assert [p["step"] for p in log["loss_curve"]] == list(range(1, 9))
    assert all(p["aux_loss"] > 0 for p in log["loss_curve"])  # the router balancing loss was on
    losses = [p["loss"] for p in log["loss_curve"]]
    assert losses[-1] < losses[0]  # it learns
    assert log["best_val_loss"] == min(v["val_loss"] for v in log["val_curve"])

    # the best checkpoint is a loadable bf16 model with the tokenizer beside it
    model, tok = models.load(run)
    assert model.dtype == torch.float32 and models.moe_info(model)["num_experts"] == 8
    assert all(v.dtype == torch.bfloat16 for v in load_file(run / "model.safetensors").values())
    assert tok.decode(tok("the sea")["input_ids"]) == "the sea"


def test_a_planted_pickle_in_the_resume_state_is_refused(tmp_path, full):
    """optim.pt loads with weights_only=True: an object that would run code on unpickling is refused, naming the
    file, and never runs."""
    out = _copy(full[2], tmp_path / "run")
    ran = tmp_path / "ran"
    torch.save({"optimizer": _Planted(str(ran))}, out / ".resume" / "optim.pt")
    with pytest.raises(ValueError, match=re.escape(str(out / ".resume" / "optim.pt")) + ": not a resume state"):
        T.train(_cfg(out))
    assert not ran.exists()


class _Planted:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):  # unpickling would create the file
        return (open, (self.path, "w"))


@pytest.mark.parametrize("cut", [".resume.old", ".resume"])
def test_a_kill_inside_the_resume_save_loses_at_most_that_save(tmp_path, monkeypatch, caplog, cut, full, at3):
    """Killed at either rename of the swap (.resume -> .resume.old, .resume.tmp -> .resume), the next run resumes
    from a complete state (the one before, or the one just written) and ends with the uninterrupted run's weights."""
    log_full, w_full, _ = full
    run = _copy(at3, tmp_path / "run")
    rename = Path.rename

    def killed(self, target):
        if Path(target).name == cut:
            raise KeyboardInterrupt("killed")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", killed)
    with pytest.raises(KeyboardInterrupt):
        T.train(_cfg(run))
    monkeypatch.setattr(Path, "rename", rename)
    with caplog.at_level("INFO", logger=T.__name__):
        resumed = T.train(_cfg(run))
    assert f"resuming {run} at step {3 if cut == '.resume.old' else 4}" in caplog.text
    assert resumed["steps"] == 8 and resumed["tokens_seen"] == log_full["tokens_seen"]
    assert not (run / ".resume.tmp").exists() and not (run / ".resume.old").exists()
    _same_weights(w_full, _weights(run))


def test_bad_values_raise_before_any_work(tmp_path):
    """Each bad value is refused before the output folder, the data or the model is made."""
    bad = [("grad_clip", -1.0), ("grad_clip", 0.0), ("lr", 0.0), ("lr", float("nan")), ("lr", float("inf")),
           ("min_lr_frac", 1.5), ("warmup_steps", -1), ("warmup_steps", 2.5), ("train_tokens", -5),
           ("stop_after", -1), ("time_budget_s", -1.0), ("eval_every", True), ("model", "nosuch"),
           ("overrides", [1]), ("min_lr_frac", -0.1), ("time_budget_s", float("nan")), ("eval_tokens", 0),
           ("eval_tokens", 2.5), ("seq_len", 4), ("amp", "fp16"), ("log_every", 0), ("seed", -1),
           ("balance", "pooled")]
    if not torch.cuda.is_available():
        bad.append(("device", "cuda"))
    for name, v in bad:
        out = tmp_path / name
        with pytest.raises(ValueError, match=re.escape(f"{name}={v!r}")):
            T.train(_cfg(out, **{name: v}))
        assert not out.exists(), name
    with pytest.raises(ValueError, match="not an embedded model .*tiny-olmoe.* or a family .*olmoe"):
        T.train(_cfg("", model="nosuch"))
    assert not (models.models_dir() / "nosuch").exists()
    with pytest.raises(ValueError, match=re.escape("overrides=[1]: must be a dict")):
        T.main(["--overrides", "[1]", "--out", str(tmp_path / "cli")])
    assert not (tmp_path / "cli").exists()
    with pytest.raises(TypeError, match="num_expert=4: not a .*Config field"):  # an override's name, before the data
        T.train(_cfg(tmp_path / "ov", overrides={"num_expert": 4}))
    assert not (tmp_path / "ov").exists()
    with pytest.raises(ValueError, match="eval_tokens=8 gives .* held-out tokens, fewer than one window"):
        T.train(_cfg(tmp_path / "x", eval_tokens=8))


def test_the_command_line_takes_the_recipe_and_honours_the_seed(tmp_path):
    """`python tools/train.py --model NAME --seed S --out DIR`: the model's shipped recipe, the seed given, and the
    checkpoint and train_log.json in DIR; a family name gets the shared tokenizer's vocabulary."""
    assert (T.recipe("tiny-mixtral").seed, T.recipe("tiny-mixtral").balance) == (1, "per-layer")
    assert T.recipe("tiny-mixtral", seed=3).seed == 3 and T.recipe("tiny-olmoe") == T.TrainConfig()
    args = ["--seq-len", "32", "--batch-size", "4", "--max-steps", "1", "--eval-every", "1", "--eval-tokens", "700",
            "--train-tokens", "4000", "--device", "cpu"]
    mixtral = {k: v for k, v in MICRO.items() if k != "num_experts"} | {"num_local_experts": 8}
    micro = ["--overrides", json.dumps(mixtral)]
    runs = {}
    for tag, extra in (("s3", ["--seed", "3"]), ("s4", ["--seed", "4"])):
        assert T.main(["--model", "tiny-mixtral", *micro, *args, *extra, "--out", str(tmp_path / tag)]) == 0
        runs[tag] = json.loads((tmp_path / tag / "train_log.json").read_text())
        assert (tmp_path / tag / "model.safetensors").exists()
    cfg = runs["s3"]["config"]
    assert cfg["seed"] == 3 and cfg["balance"] == "per-layer" and cfg["out"] == str(tmp_path / "s3")
    assert runs["s3"]["loss_curve"][0]["loss"] != runs["s4"]["loss_curve"][0]["loss"]  # the seed sets the weights
    T.main(["--model", "olmoe", *args, "--out", str(tmp_path / "fam")])
    assert json.loads((tmp_path / "fam" / "config.json").read_text())["vocab_size"] >= 8000


def test_card_scores_the_unseen_heldout_slices_and_flags_seen_validation_text(tmp_path, full):
    """The card's held-out losses are on exactly heldout_texts() (text never trained on) and agree with
    moelab.evaluate.perplexity on the same windows; its unigram floor is fitted on the tokens the run trained on;
    a log whose validation used slices that repeat training text says so in the card."""
    import math

    from moelab.data import heldout_texts
    from moelab.evaluate import perplexity
    from moelab.results import command_line

    out = _copy(full[2], tmp_path / "m")
    log = json.loads((out / "train_log.json").read_text())
    held = heldout_texts()
    assert log["validation_texts"] == list(held)
    T.write_card(out, eval_tokens=512, stats_tokens=512 * len(held))
    ev = json.loads((out / "eval.json").read_text())
    assert list(ev["heldout_loss"]) == list(held) == ev["router"]["texts"]
    assert ev["command"] == command_line()  # the card records the command line that made it
    assert ev["unigram"]["train_tokens"] == log["train_tokens"] == 4000
    model, tok = models.load(out)
    L = min(512, model.config.max_position_embeddings)
    for name, loss in ev["heldout_loss"].items():
        ids = T._stream(tok, {name: held[name]}, ev["heldout_tokens_each"])
        ids = ids[: (ids.numel() // L) * L]
        ref = perplexity(model, tok, ids, context=L, stride=L, progress=False)
        assert math.isclose(loss, ref["nll"], rel_tol=1e-5), (name, loss, ref["nll"])
    assert ev["heldout_scored_tokens"] == {
        name: (T._stream(tok, {name: held[name]}, ev["heldout_tokens_each"]).numel() // L) * (L - 1) for name in held}
    card = (out / "README.md").read_text()
    assert all(f"| {name} | {ev['heldout_scored_tokens'][name]:,} |" in card for name in held)
    assert "repeat training text" not in card
    assert "unchanged model scores" not in card  # the committed full-test runs are of the embedded models only
    with pytest.raises(ValueError, match=r"stats_tokens=1000: must be an int >= "):
        T.evaluate_checkpoint(out, eval_tokens=512, stats_tokens=1000)

    log["validation_texts"] = ["tinyshakespeare", "olmoe_arxiv"]  # as the first trained models' logs say
    (out / "train_log.json").write_text(json.dumps(log))
    # a checkpoint folder named like an embedded model is not that model: no line from its committed runs
    named = out.rename(tmp_path / "tiny-olmoe")
    T.write_card(named, reuse=True)
    card = (named / "README.md").read_text()
    assert "(1 of which repeat training text" in card and "unchanged model scores" not in card


def test_train_tokens_are_the_first_of_the_whole_stream():
    """train_tokens=N takes the first N tokens of the joined training texts, continuing into the next text
    when the first is shorter."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models.tokenizer_dir())
    texts = {"a": "To be, or not to be, that is the question.", "b": "The quick brown fox jumps. " * 40}
    full = T._train_ids(tok, texts)
    n_a = len(tok(texts["a"], add_special_tokens=False)["input_ids"]) + 1  # with its EOS
    assert full.numel() > n_a + 30
    for n in (5, n_a, n_a + 30):
        assert torch.equal(T._train_ids(tok, texts, n), full[:n])


def test_per_layer_balance_loss_sees_what_the_pooled_loss_misses():
    """transformers' balancing loss pools the expert loads over layers: two layers each sending every token to
    two of four experts (different ones) sit at its minimum k. Taken per layer the same routers score 2k; with
    one layer both losses agree."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    T_, E, k = 64, 4, 1
    big = torch.full((T_, E), -20.0)
    l0, l1 = big.clone(), big.clone()
    l0[: T_ // 2, 0] = l0[T_ // 2 :, 1] = 20.0  # layer 0: experts 0 and 1, half the tokens each
    l1[: T_ // 2, 2] = l1[T_ // 2 :, 3] = 20.0  # layer 1: experts 2 and 3
    assert float(load_balancing_loss_func((l0, l1), E, k)) == pytest.approx(k, abs=1e-6)  # looks balanced
    assert float(T.balance_loss((l0, l1), E, k)) == pytest.approx(2 * k, abs=1e-6)
    torch.manual_seed(0)
    r = torch.randn(T_, E)
    assert float(T.balance_loss((r,), E, 2)) == pytest.approx(float(load_balancing_loss_func((r,), E, 2)), rel=1e-5)
    uniform = torch.zeros(T_, E)
    uniform[torch.arange(T_), torch.arange(T_) % E] = 1e-3  # each expert top-1 for a quarter of the tokens
    assert float(T.balance_loss((uniform, uniform), E, 1)) == pytest.approx(1.0, abs=1e-3)


def test_per_layer_balance_trains(tmp_path, full):
    """balance='per-layer' swaps only the router loss: the first step's next-token loss is the model's own."""
    log = T.train(_cfg(tmp_path, balance="per-layer", max_steps=4, eval_every=4))
    assert log["config"]["balance"] == "per-layer"
    auxes = [p["aux_loss"] for p in log["loss_curve"]]
    assert all(2 - 1e-3 < a < 8 for a in auxes)  # k = 2 when every layer is balanced, E = 8 when collapsed
    losses = [p["loss"] for p in log["loss_curve"]]
    assert losses[-1] < losses[0]
    assert losses[0] == pytest.approx(full[0]["loss_curve"][0]["loss"], rel=1e-5)


@pytest.mark.parametrize("family", sorted(models.FAMILIES))
def test_per_layer_forward_skips_the_pooled_loss(family, monkeypatch):
    """The per-layer mode's forward gives the model's own logits and router logits, and never calls the
    family's pooled balancing loss (it would be computed for nothing)."""
    import transformers

    if not hasattr(transformers, models.FAMILIES[family][1]):
        pytest.skip(f"this transformers has no {family}")
    few = {"num_experts": 8, "num_experts_per_tok": 2} if family in ("qwen3_next", "qwen3_5_moe") else {}
    m = models.tiny_random(family, seed=2, **few)  # the two with hundreds of experts get 8
    x = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = m(input_ids=x, use_cache=False, output_router_logits=True)
        modeling = sys.modules[type(m).__module__]
        assert hasattr(modeling, "load_balancing_loss_func")  # what the causal-LM forward would call

        def pooled(*a, **kw):
            raise AssertionError("the pooled balancing loss was computed")

        monkeypatch.setattr(modeling, "load_balancing_loss_func", pooled)
        logits, router_logits = T._logits_and_router_logits(m, x)
    torch.testing.assert_close(logits, ref.logits, rtol=0, atol=0)
    assert len(router_logits) == len(ref.router_logits)
    for got, want in zip(router_logits, ref.router_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
