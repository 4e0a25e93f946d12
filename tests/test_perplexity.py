"""Sliding-window perplexity: every token after the first is scored once, with the right context."""

import math
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import MixtralConfig, MixtralForCausalLM

from moelab.perplexity import perplexity, token_ids, windows


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = MixtralConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )
    return MixtralForCausalLM(cfg).eval()


def reference_nll(model, ids, context, stride):
    """Token by token: log p(ids[j] | the window that scores j), from full-window logits."""
    total, n = 0.0, 0
    for begin, end, scored in windows(len(ids), context, stride):
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids[None, begin:end]).logits[0].float(), -1)
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


def test_matches_token_by_token_reference(model):
    ids = torch.randint(0, 97, (150,), generator=torch.Generator().manual_seed(1))
    out = perplexity(model, None, ids, context=32, stride=8, progress=False)
    ref, n = reference_nll(model, ids, 32, 8)
    assert out["scored_tokens"] == n == 149
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


def test_batch_size_does_not_change_result(model):
    ids = torch.randint(0, 97, (200,), generator=torch.Generator().manual_seed(2))
    a = perplexity(model, None, ids, context=24, stride=6, batch_size=1, progress=False)
    b = perplexity(model, None, ids, context=24, stride=6, batch_size=5, progress=False)
    assert a["scored_tokens"] == b["scored_tokens"]
    assert a["nll"] == pytest.approx(b["nll"], rel=1e-5)


def test_context_clipped_to_model_and_max_tokens(model):
    ids = torch.randint(0, 97, (300,), generator=torch.Generator().manual_seed(3))
    out = perplexity(model, None, ids, context=2048, stride=512, max_tokens=200, progress=False)
    assert out["context"] == 64 and out["stride"] == 64
    assert out["windows"] == 4 and out["scored_tokens"] == 200 - 4  # no overlap: each window's first unscored
    # one window covering everything equals the model's own mean loss
    one = perplexity(model, None, ids[:50], context=64, stride=16, progress=False)
    with torch.no_grad():
        loss = model(input_ids=ids[None, :50], labels=ids[None, :50]).loss
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


def test_ids_outside_the_vocabulary_and_bad_context_are_named(model):
    """An id the embedding cannot look up is named with its position (not an IndexError or a device assert)."""
    ids = torch.arange(20) % 97
    ids[7] = 500
    with pytest.raises(ValueError, match=r"token id 500 at position 7: must be in \[0, vocab_size=97\)"):
        perplexity(model, None, ids, context=16, stride=8, progress=False)
    with pytest.raises(ValueError, match=r"token id -1 at position 0"):
        perplexity(model, None, torch.tensor([-1, 2, 3]), context=16, stride=8, progress=False)
    with pytest.raises(ValueError, match=r"context=0: must be >= 2"):
        perplexity(model, None, torch.arange(10), context=0, stride=1, progress=False)
    with pytest.raises(ValueError, match=r"context=16.0: must be an int"):
        perplexity(model, None, torch.arange(10), context=16.0, stride=8, progress=False)


def test_ids_past_max_tokens_are_not_checked(model):
    """Only what the model reads must be in the vocabulary: max_tokens cuts the stream first."""
    ids = torch.arange(40) % 97
    ids[30] = 500
    r = perplexity(model, None, ids, context=16, stride=8, max_tokens=24, progress=False)
    assert r == perplexity(model, None, ids[:24], context=16, stride=8, progress=False)
    assert r["scored_tokens"] == 23 and math.isfinite(r["ppl"])
    for bad in (1, 0, True, 24.0):
        with pytest.raises(ValueError, match=rf"max_tokens={bad!r}: must be an int >= 2 or None"):
            perplexity(model, None, ids, context=16, stride=8, max_tokens=bad, progress=False)
    assert perplexity(model, None, ids, context=16, stride=8, max_tokens=2, progress=False)["scored_tokens"] == 1


def test_non_finite_logits_raise_at_the_first_bad_window():
    """A NaN weight fails the window that reads it, as the patched path's router check does, and the later windows
    are not run; the message names the logit and the window."""
    from moelab.models import tiny_random

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


def test_ids_of_a_wrong_type_and_numpy_ints(model):
    with pytest.raises(ValueError, match=r"token ids of dtype torch.complex64: must be integers"):
        token_ids(None, torch.ones(4, dtype=torch.complex64))
    for bad in (None, ["a", "b"]):
        with pytest.raises(TypeError, match=rf"text_or_ids={re.escape(repr(bad))}: must be a str \(with a tokenizer\)"):
            perplexity(model, None, bad, progress=False)
    ids = torch.arange(40) % 97
    want = perplexity(model, None, ids, context=16, stride=8, max_tokens=30, batch_size=2, progress=False)
    got = perplexity(model, None, ids, context=np.int64(16), stride=np.int32(8), max_tokens=np.int64(30),
                     batch_size=np.int64(2), progress=False)
    assert got == want and type(got["context"]) is int
