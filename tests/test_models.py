"""The embedded models: they load and generate, beat a unigram model by far, and their routers are not collapsed."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from moelab import models
from moelab.data import eval_text, heldout_texts, training_texts
from moelab.evaluate import perplexity
from moelab.hf import router_logits

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from tokenizer import encode, unigram_perplexity  # noqa: E402  (tools/tokenizer.py)
from train import _stream  # noqa: E402  (tools/train.py)

EXPECTED = {  # name -> (family, experts, k, renormalise)
    "tiny-mixtral": ("mixtral", 8, 2, True),
    "tiny-qwen-moe": ("qwen2_moe", 60, 4, False),
    "tiny-olmoe": ("olmoe", 64, 8, False),
}
TRAINED = [n for n in models.NAMES if (models.model_dir(n) / "model.safetensors").exists()]
needs_ckpt = pytest.mark.skipif(len(TRAINED) < 3, reason="data/models checkpoints missing (python tools/train.py)")


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(models.tokenizer_dir())


@pytest.fixture(scope="module")
def test_ids(tok):
    return encode(tok, eval_text()[:20_000])[:1024]


@pytest.fixture(scope="module")
def unigram(tok, test_ids):  # fitted on the first 50k tokens of each training text
    return unigram_perplexity(tok, _stream(tok, training_texts(), per_text=50_000).tolist(), test_ids)


@pytest.fixture(scope="module")
def loaded():
    """models.load(name), once per name for the module."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = models.load(name)
        return cache[name]

    return get


def test_registry_configs():
    cfgs = {name: models.build_config(name) for name in models.NAMES}
    assert set(cfgs) == set(EXPECTED)
    for name, (family, E, k, renorm) in EXPECTED.items():
        assert models.moe_info(cfgs[name]) | {"shared_expert": True} == {
            "num_experts": E, "native_k": k, "renormalize": renorm, "family": family, "shared_expert": True}
    assert cfgs["tiny-qwen-moe"].shared_expert_intermediate_size > 0
    assert models.moe_info(cfgs["tiny-olmoe"]).get("shared_expert") is None


@needs_ckpt
@pytest.mark.parametrize("name", list(EXPECTED))
def test_checkpoint_loads_and_generates(name, loaded):
    family, E, k, renorm = EXPECTED[name]
    model, tok = loaded(name)
    assert model.dtype == torch.float32 and not model.training
    assert models.moe_info(model) == {"num_experts": E, "native_k": k, "renormalize": renorm, "family": family,
                                      **({"shared_expert": True} if family == "qwen2_moe" else {})}
    assert (models.model_dir(name) / "model.safetensors").stat().st_size < 40e6
    x = tok("The history of the city", return_tensors="pt")
    out = model.generate(**x, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    new = tok.decode(out[0, x["input_ids"].shape[1]:])
    assert out.shape[1] == x["input_ids"].shape[1] + 12 and new.strip()


@needs_ckpt
@pytest.mark.parametrize("name", list(EXPECTED))
def test_perplexity_far_below_unigram(name, test_ids, unigram, loaded):
    model, tok = loaded(name)
    res = perplexity(model, tok, test_ids, progress=False)
    assert len(test_ids) - res["windows"] <= res["scored_tokens"] < len(test_ids)
    # a model that learned anything beyond token frequencies: at most a quarter of the unigram perplexity
    assert res["ppl"] < unigram["ppl"] / 4, (res["ppl"], unigram["ppl"])


@needs_ckpt
@pytest.mark.parametrize("name", list(EXPECTED))
def test_routers_not_collapsed(name, tok, loaded):
    """On 4k tokens of the held-out slices no model trained on, and on 4k of WikiText-2 test, text that neither
    trained nor picked a checkpoint: every layer's load is balanced, and per-token entropy spreads."""
    model, _ = loaded(name)
    st = models.router_stats(model, _stream(tok, heldout_texts(), per_text=2048))
    assert st["tokens"] == 4096 and len(st["load_entropy"]) == model.config.num_hidden_layers
    assert min(st["load_entropy"]) >= 0.8, st["load_entropy"]
    for q05, _q25, q50, _q75, q95 in st["token_entropy_q"]:
        assert q05 < q50 < q95
        assert q95 - q05 >= 0.1, st["token_entropy_q"]  # per-token entropy spreads over a real range
        assert q05 < 0.95  # some tokens are routed with confidence, not all near-uniform
    st = models.router_stats(model, encode(tok, eval_text()[:40_000])[:4096])
    assert st["tokens"] == 4096 and min(st["load_entropy"]) >= 0.8, st["load_entropy"]


@needs_ckpt
@pytest.mark.parametrize("name", list(EXPECTED))
def test_model_card_reports_balanced_routers_on_unseen_text(name):
    """The card's router table (eval.json) is measured on text no model trained on, and every layer is >= 0.8."""
    ev = json.loads((models.model_dir(name) / "eval.json").read_text())["router"]
    assert ev["texts"] == list(heldout_texts()) and ev["tokens"] >= 16384
    assert min(ev["load_entropy"]) >= 0.8, ev["load_entropy"]
    # and the card says how balanced the routers are on the evaluation text, which picked nothing
    test = json.loads((models.model_dir(name) / "eval.json").read_text())["router_test"]
    assert test["tokens"] >= 16384 and len(test["load_entropy"]) == len(ev["load_entropy"])
    assert min(test["load_entropy"]) >= 0.8, test["load_entropy"]
    assert " / ".join(f"{x:.3f}" for x in test["load_entropy"]) in (models.model_dir(name) / "README.md").read_text()


@needs_ckpt
@pytest.mark.parametrize("name", list(EXPECTED))
def test_committed_model_card_is_what_its_eval_and_the_committed_results_give(name):
    """README.md is the card `tools/train.py --card` writes from the committed eval.json, train_log.json and
    the newest committed paper-tables run: a rerun of either without the card rebuilt fails here."""
    from train import _card

    folder = models.model_dir(name)
    ev, tlog = (json.loads((folder / f).read_text()) for f in ("eval.json", "train_log.json"))
    assert _card(name, folder, ev, tlog) == (folder / "README.md").read_text(), (
        f"rebuild it: python tools/train.py --model {name} --card --card-reuse")


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        models.load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        models.load(tmp_path / "empty")
    from transformers import LlamaConfig, LlamaForCausalLM

    dense = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    dense.save_pretrained(tmp_path / "dense")
    with pytest.raises(ValueError, match=r"dense: model_type='llama': not an MoE model"):
        models.load(tmp_path / "dense")
    with pytest.raises(ValueError, match="not an embedded model"):
        models.model_dir("tiny-gpt")


def test_device_and_dtype_choice():
    """'auto' follows the machine (notebooks default to it); float32 stays float32 on any device."""
    cuda = torch.cuda.is_available()
    assert models.pick_device("auto").type == ("cuda" if cuda else "cpu")
    assert models.pick_device(None).type == "cpu"
    assert models.pick_dtype("auto", torch.device("cpu")) == torch.float32
    assert models.pick_dtype(None, torch.device("cuda")) == torch.bfloat16
    assert models.pick_dtype("float32", torch.device("cuda")) == torch.float32
    assert models.pick_dtype(torch.float16, torch.device("cpu")) == torch.float16
    with pytest.raises(ValueError, match=r"device='gpu': must be 'auto', 'cpu', 'cuda' or 'cuda:N'"):
        models.pick_device("gpu")
    with pytest.raises(ValueError, match=r"dtype='fp8': must be 'auto' or one of"):
        models.pick_dtype("fp8", torch.device("cpu"))
    if not cuda:
        with pytest.raises(ValueError, match="no CUDA device"):
            models.pick_device("cuda")


@needs_ckpt
def test_load_device_dtype():
    net, _ = models.load("tiny-mixtral", device="auto", dtype="bfloat16")
    assert next(net.parameters()).dtype == torch.bfloat16
    assert next(net.parameters()).device.type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_reference_experts_switches_the_unpatched_blocks_to_the_eager_loop():
    """Notebook 05 and paper_tables.py share it, so their baselines run the same expert code in every dtype."""
    net, _ = models.load("tiny-olmoe", dtype="bfloat16")
    assert models.reference_experts(net) == "eager" == net.config._experts_implementation
    ids = torch.arange(64)[None]
    with torch.no_grad():
        assert torch.isfinite(net(ids).logits).all()


def test_a_local_folder_named_like_an_embedded_model(tmp_path, monkeypatch, tok):
    """A Path (or './name') is always the folder; a bare name that is also a folder here is ambiguous."""
    m = models.tiny_random("olmoe", vocab_size=len(tok))
    m.save_pretrained(tmp_path / "tiny-mixtral")
    tok.save_pretrained(tmp_path / "tiny-mixtral")
    monkeypatch.chdir(tmp_path)
    for ref in (Path("tiny-mixtral"), "./tiny-mixtral", tmp_path / "tiny-mixtral"):
        assert models.resolve(ref).resolve() == (tmp_path / "tiny-mixtral").resolve()
    with pytest.raises(ValueError, match="both an embedded model and a folder here"):
        models.resolve("tiny-mixtral")
    loaded, _ = models.load(Path("tiny-mixtral"), device_map="cpu")
    assert type(loaded).__name__ == "OlmoeForCausalLM"
    assert loaded.dtype == torch.float32  # a CPU device map keeps the CPU default


@pytest.mark.parametrize("family", sorted(models.FAMILIES))
def test_tiny_random(family):
    import transformers

    if not hasattr(transformers, models.FAMILIES[family][1]):
        with pytest.raises(ValueError, match=f"family={family!r}: this transformers"):
            models.tiny_random(family)
        pytest.skip(f"this transformers has no {family}")
    m = models.tiny_random(family, seed=1)
    info = models.moe_info(m)
    assert info["family"] == family and 0 < info["native_k"] <= info["num_experts"]
    out = m(input_ids=torch.randint(0, 256, (2, 8)), output_router_logits=True)
    assert out.logits.shape == (2, 8, 256)
    assert out.router_logits[0].shape == (16, info["num_experts"])
    same = models.tiny_random(family, seed=1)
    torch.testing.assert_close(m(input_ids=torch.arange(8)[None]).logits, same(input_ids=torch.arange(8)[None]).logits)
    assert models.tiny_random("mixtral", num_local_experts=4).config.num_local_experts == 4
    with pytest.raises(ValueError, match="family='gpt2'"):
        models.tiny_random("gpt2")


def test_unigram_perplexity_takes_tensors_as_lists(tok, test_ids):
    """Ids as a tensor count as the same ids (a tensor's elements are 0-d tensors, which hash by identity)."""
    train = encode(tok, "the sea and the land and the sea " * 20)
    want = unigram_perplexity(tok, train, test_ids[:200])
    assert unigram_perplexity(tok, torch.tensor(train), torch.tensor(test_ids[:200])) == want
    assert want["ppl"] < len(tok)  # the training counts were used


def test_router_stats_and_ids_checks():
    net = models.tiny_random("mixtral")
    vocab = net.get_input_embeddings().num_embeddings
    with pytest.raises(ValueError, match=rf"token id {vocab} at position 3: must be in \[0, vocab_size={vocab}\)"):
        models.check_ids(net, torch.tensor([0, 1, 2, vocab]))
    with pytest.raises(ValueError, match="dtype torch.float32: must be an integer tensor"):
        models.check_ids(net, torch.tensor([0.0, 1.0]))
    for kw, match in ((dict(seq_len=0), "seq_len=0: must be an int >= 1 or None"),
                      (dict(batch_size=0), "batch_size=0: must be an int >= 1")):
        with pytest.raises(ValueError, match=match):
            models.router_stats(net, torch.arange(64), **kw)


@pytest.mark.parametrize("device_map, cuda", [
    ("auto", True), ("balanced", True), ("sequential", True), ("balanced_low_0", True), ("cpu", False),
    ({"": "cpu"}, False), ({"model": "cpu", "lm_head": "disk"}, False), ({"": 0}, True), ("cuda:0", True),
])
def test_a_device_map_picks_the_dtype_of_where_the_weights_go(device_map, cuda):
    """Strategy names are CUDA where there is one; a GPU target on a machine without CUDA names the map."""
    if cuda and not torch.cuda.is_available():
        if isinstance(device_map, str) and device_map in models.MAP_STRATEGIES:
            assert models.map_device(device_map).type == "cpu"
        else:
            with pytest.raises(ValueError, match=r"device_map=.*no CUDA device"):
                models.map_device(device_map)
        return
    assert models.map_device(device_map).type == ("cuda" if cuda else "cpu")


def test_a_checkpoint_without_tokenizer_fails_before_loading_weights(tmp_path, monkeypatch):
    """The tokenizer check comes first: a large checkpoint is not read only to fail afterwards."""
    import transformers

    models.tiny_random("olmoe").save_pretrained(tmp_path / "ckpt")
    called = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: called.append(a))
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        models.load(tmp_path / "ckpt")
    assert not called


def test_router_stats_load_entropy_is_normalised_by_the_expert_count():
    """load_entropy[l] is the entropy of layer l's load over log(E) (data.normalised_entropy's rule), so at most 1;
    each token adds k selections; a seq_len longer than the model's context is clipped to it."""
    from moelab.data import normalised_entropy

    net = models.tiny_random("mixtral")
    info = models.moe_info(net)
    ids = torch.randint(0, 256, (512,), generator=torch.Generator().manual_seed(0))
    st = models.router_stats(net, ids, seq_len=64)
    assert st["tokens"] == 512 and len(st["load"]) == len(st["load_entropy"]) == net.config.num_hidden_layers
    for ent, load in zip(st["load_entropy"], st["load"]):
        assert len(load) == info["num_experts"] and sum(load) == st["tokens"] * info["native_k"]
        assert ent == pytest.approx(normalised_entropy(load), abs=1e-9) and 0 < ent <= 1
    lg = router_logits(net, ids, context=64)  # per-token entropies, from the router logits themselves
    for layer, q in enumerate(st["token_entropy_q"]):
        logp = torch.log_softmax(lg[layer].float(), -1)
        h = -(logp.exp() * logp).sum(-1) / np.log(info["num_experts"])
        want = torch.quantile(h, torch.tensor(st["token_entropy_quantiles"])).tolist()
        np.testing.assert_allclose(q, want, rtol=1e-5)
    ctx = models.model_context(net)
    long = models.router_stats(net, ids[: 2 * ctx], seq_len=100 * ctx)  # clipped: two chunks of ctx tokens
    assert long["tokens"] == 2 * ctx


def test_check_ids_refuses_a_negative_id_and_names_its_position():
    net = models.tiny_random("mixtral")
    vocab = net.get_input_embeddings().num_embeddings
    with pytest.raises(ValueError, match=rf"token id -1 at position 2: must be in \[0, vocab_size={vocab}\)"):
        models.check_ids(net, torch.tensor([0, 5, -1, 2]))
    ids = torch.tensor([0, vocab - 1])
    assert models.check_ids(net, ids) is ids


def test_build_refuses_k_outside_the_expert_count_and_n_params_counts_tied_weights_once():
    E = models.build_config("tiny-mixtral").num_local_experts
    for k in (0, E + 1):
        with pytest.raises(ValueError, match=rf"num_experts_per_tok={k}: must be in \[1, num_experts={E}\]"):
            models.build("mixtral", num_experts_per_tok=k, num_local_experts=E)
    tied = models.tiny_random("mixtral", tie_word_embeddings=True)
    untied = models.tiny_random("mixtral", tie_word_embeddings=False)
    assert tied.lm_head.weight is tied.get_input_embeddings().weight
    # the tied model lacks exactly the untied one's separate output matrix (vocab x hidden)
    assert models.n_params(untied) - models.n_params(tied) == untied.lm_head.weight.numel()
    assert models.n_params(untied) == sum(p.numel() for _, p in untied.named_parameters(remove_duplicate=False))


def test_fingerprint_covers_names_sizes_and_both_edges_only(tmp_path):
    """sha256 over each file's name, size and first and last edge_bytes: a change at the end or a rename changes
    it; a change between the two edges of a file longer than 2 * edge_bytes does not."""
    (tmp_path / "config.json").write_text("{}")
    f, edge = tmp_path / "model.safetensors", 100
    buf = bytearray(3 * edge)
    f.write_bytes(bytes(buf))
    first = models.fingerprint(tmp_path, edge_bytes=edge)
    buf[-1] = 1
    f.write_bytes(bytes(buf))
    tail = models.fingerprint(tmp_path, edge_bytes=edge)
    assert tail != first
    buf[0] = 1
    f.write_bytes(bytes(buf))
    head = models.fingerprint(tmp_path, edge_bytes=edge)
    assert head != tail
    whole = models.fingerprint(tmp_path)  # default edge_bytes: all of a small file
    buf[len(buf) // 2] = 1  # outside both edges
    f.write_bytes(bytes(buf))
    assert models.fingerprint(tmp_path, edge_bytes=edge) == head
    assert models.fingerprint(tmp_path) != whole
    f.rename(tmp_path / "other.safetensors")  # same bytes, another name
    assert models.fingerprint(tmp_path, edge_bytes=edge) != head
    assert len(head) == 16


def test_fingerprint_reads_pytorch_pickles_where_there_is_no_safetensors(tmp_path):
    """A checkpoint saved with safe_serialization=False (pytorch_model.bin), which load() takes, has a fingerprint
    too; safetensors win where both are there; a folder with neither is named with the patterns looked for."""
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"no weight files to fingerprint \(\*\.safetensors, \*\.bin"):
        models.fingerprint(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x01" * 64)
    pickled = models.fingerprint(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x02" * 64)
    assert models.fingerprint(tmp_path) != pickled and len(pickled) == 16
    (tmp_path / "model.safetensors").write_bytes(b"\x03" * 64)
    only = models.fingerprint(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x04" * 64)
    assert models.fingerprint(tmp_path) == only  # the pickle is not read beside safetensors


def test_a_missing_relative_path_is_named_with_the_working_folder(tmp_path, monkeypatch):
    """A relative checkpoint path resolves against the working folder (papermill's --cwd notebooks moves it): the
    error names both, so the cause is plain."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as e:
        models.resolve("ckpt/m")
    assert str(e.value).startswith(f"ckpt/m: no such directory (relative to the working folder {tmp_path}: "
                                   f"{tmp_path / 'ckpt' / 'm'}); pass one of")
    with pytest.raises(FileNotFoundError, match=r"^/nonexistent/m: no such directory; pass one of"):
        models.resolve("/nonexistent/m")


@pytest.mark.parametrize("k", [0, 20])
def test_load_refuses_a_checkpoint_whose_k_is_outside_the_expert_count(tmp_path, k):
    """The config alone is enough: no tokenizer or weights are there, so the check comes before both."""
    cfg = models.tiny_random("mixtral").config
    cfg.num_experts_per_tok = k
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"{tmp_path}: num_experts_per_tok={k}: must be in \[1, num_experts=8\]"):
        models.load(tmp_path)
    with pytest.raises(ValueError, match=rf"num_experts_per_tok={k}: must be in \[1, num_experts=8\]"):
        models.moe_info(cfg)


def test_build_checks_override_names_and_sizes():
    with pytest.raises(TypeError, match=r"num_expert=4: not a MixtralConfig field; valid overrides: \[.*'num_local_e"):
        models.build("mixtral", num_expert=4)
    for key, v in (("num_hidden_layers", -1), ("vocab_size", 0), ("hidden_size", 64.0), ("num_local_experts", True),
                   ("max_position_embeddings", 0), ("hidden_size", None)):  # None: only head_dim / kv heads
        with pytest.raises(ValueError, match=rf"{key}={v!r}: must be an int >= 1"):
            models.build("mixtral", **{key: v})
    net = models.build("mixtral", num_local_experts=np.int64(4), num_experts_per_tok=np.int32(1), head_dim=None)
    assert models.moe_info(net) | {"family": None} == {"num_experts": 4, "native_k": 1, "renormalize": True,
                                                       "family": None}  # numpy ints are ints
    assert models.build("tiny-mixtral", num_hidden_layers=1).config.num_hidden_layers == 1


def test_build_refuses_sizes_its_forward_cannot_take_and_the_same_sizes_run_where_they_can():
    x = torch.zeros(1, 4, dtype=torch.long)
    for family, d in (("mixtral", 30), ("olmoe", 36), ("qwen2_moe", 30)):  # head_dim = d / 4 heads: 7.5, 9 (odd)
        with pytest.raises(ValueError, match=rf"hidden_size={d}: must be a multiple of 2 \* num_attention_heads=4"):
            models.build(family, hidden_size=d)
    models.build("olmoe", hidden_size=40)(x)  # head_dim 10
    for family, key in (("qwen3_moe", "hidden_size"), ("mixtral", "intermediate_size"),
                        ("qwen3_moe", "moe_intermediate_size")):
        with pytest.raises(ValueError, match=rf"{key}=30: must be a multiple of 4 for transformers' grouped_mm"):
            models.build(family, **{key: 30})
        models.build(family, experts_implementation="eager", **{key: 30})(x)  # its own head_dim: the size runs
    models.build("qwen3_moe", hidden_size=36)(x)


def test_load_refuses_an_empty_path_and_names_a_truncated_weights_file(tmp_path, tok):
    with pytest.raises(ValueError, match=r"name_or_path='': empty"):
        models.load("")
    with pytest.raises(TypeError, match=r"name_or_path=None: must be a str or a path"):
        models.load(None)
    models.tiny_random("mixtral").save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ValueError, match=rf"{f}: .*incomplete metadata.* \(a truncated or corrupt weights file\?\)"):
        models.load(tmp_path)


def test_check_ids_and_router_stats_refuse_ids_of_the_wrong_type():
    net = models.tiny_random("mixtral")
    with pytest.raises(TypeError, match=r"ids=\[1, 2\]: must be a torch.Tensor of token ids"):
        models.check_ids(net, [1, 2])
    with pytest.raises(TypeError, match=r"ids='hello': must be token ids \(a list, array or tensor of ints\)"):
        models.router_stats(net, "hello")
    assert models.router_stats(net, list(range(64)), seq_len=32)["tokens"] == 64  # a list of ints still counts


def test_unigram_perplexity_refuses_ids_outside_the_vocabulary(tok):
    V = len(tok)
    for bad in (V, 999999, -3):
        rule = rf"must be in \[0, vocab_size={V}\)"
        with pytest.raises(ValueError, match=rf"eval_text: token id {bad} at position 1: {rule}"):
            unigram_perplexity(tok, "hello", [3, bad])
    with pytest.raises(ValueError, match=rf"train_text: token id {V} at position 0"):
        unigram_perplexity(tok, [V], [3])
    assert unigram_perplexity(tok, [0, V - 1], [V - 1])["scored_tokens"] == 1


def _embedded_copy(tmp_path, monkeypatch, name="tiny-mixtral"):
    """A data folder with one embedded model, its tokenizer and SHA256SUMS, as MOELAB_DATA."""
    import shutil

    src = models.model_dir(name).parent  # the weights unpacked from their .xz first
    shutil.copy(src.parent / "SHA256SUMS", tmp_path)
    for sub in (name, "tokenizer"):
        shutil.copytree(src / sub, tmp_path / "models" / sub, symlinks=True)
    monkeypatch.setenv("MOELAB_DATA", str(tmp_path))
    return tmp_path / "models" / name


@pytest.mark.parametrize("file", ["model.safetensors", "tokenizer.json", "config.json"])
def test_an_altered_embedded_model_file_is_refused_by_name(tmp_path, monkeypatch, file):
    """Each file of an embedded model is checked against data/SHA256SUMS before anything is loaded."""
    f = _embedded_copy(tmp_path, monkeypatch) / file
    raw = bytearray(f.read_bytes())
    if file == "model.safetensors":  # 4 KiB flipped in the middle of the weights
        mid = len(raw) // 2
        raw[mid : mid + 4096] = bytes(b ^ 0xFF for b in raw[mid : mid + 4096])
    elif file == "tokenizer.json":  # written through the link, into the shared tokenizer
        raw = bytearray(b"\xff\xfe garbage")
    else:
        raw = raw[: len(raw) // 2]
    f.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=rf"{tmp_path}/models/[\w-]+/{file}: sha256 \w+ does not match SHA256SUMS"):
        models.load("tiny-mixtral")


@pytest.fixture(scope="module")
def local_ckpt(tmp_path_factory, tok):
    d = tmp_path_factory.mktemp("ckpt") / "m"
    models.tiny_random("mixtral").save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_a_local_checkpoint_with_non_finite_weights_is_refused_by_tensor_name(tmp_path, local_ckpt):
    import shutil
    import struct

    d = shutil.copytree(local_ckpt, tmp_path / "m")
    f = d / "model.safetensors"
    raw = bytearray(f.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    start = 8 + n + json.loads(raw[8 : 8 + n])["model.embed_tokens.weight"]["data_offsets"][0]
    raw[start + 4096 : start + 8192] = b"\xff" * 4096  # NaN in fp32 and bf16
    f.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=rf"{d}: non-finite values in 1 weight tensor\(s\): model.embed_tokens.weight"):
        models.load(d)


@pytest.mark.parametrize("file, damage", [("tokenizer.json", b"\xff\xfe{garbage"), ("tokenizer.json", b'{"model": '),
                                          ("config.json", None), ("tokenizer_config.json", b"[1, 2")])
def test_a_corrupt_json_file_of_a_local_checkpoint_is_named_before_the_weights_load(tmp_path, monkeypatch, local_ckpt,
                                                                                   file, damage):
    import shutil

    import transformers

    d = shutil.copytree(local_ckpt, tmp_path / "m")
    f = d / file
    f.write_bytes(damage if damage is not None else f.read_bytes()[:-20])
    called = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: called.append(a))
    with pytest.raises(ValueError, match=rf"{f}: not valid JSON"):
        models.load(d)
    assert not called
