"""Test-session set-up that must happen before any test module imports triton, and the --fill-empty option."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run interpreted on a CPU; the flag is read when a kernel is decorated, so it must
    # be set before the first `import moelab.kernels...` of any test module.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def fill_empty(setattr_, value: float) -> None:
    """Make torch.empty, empty_like and Tensor.new_empty fill what they return (`value` in floats, -7 in
    integers) through setattr_(obj, name, new): monkeypatch.setattr in a test, setattr for a session."""
    def fill(t):
        return t.fill_(value if t.is_floating_point() else -7) if t.dtype != torch.bool else t
    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty
    setattr_(torch, "empty", lambda *a, **k: fill(empty(*a, **k)))
    setattr_(torch, "empty_like", lambda *a, **k: fill(empty_like(*a, **k)))
    setattr_(torch.Tensor, "new_empty", lambda self, *a, **k: fill(new_empty(self, *a, **k)))


def pytest_addoption(parser):
    parser.addoption("--fill-empty", action="store_true",
                     help="fill every torch.empty buffer with NaN (floats) / -7 (integers) for the whole session, so "
                          "a result read from memory before it is written shows as a failing test")


def pytest_configure(config):
    if config.getoption("--fill-empty"):
        fill_empty(setattr, float("nan"))


@pytest.fixture(scope="module")
def spread_mixtral():
    """A 2-layer random Mixtral whose routers have real spread: what the calibration and paper-table tests route."""
    from moelab.hf import moe_layers
    from moelab.models import tiny_random

    m = tiny_random("mixtral", num_hidden_layers=2)
    for layer in moe_layers(m):
        torch.nn.init.normal_(layer.block.gate.weight, std=0.4)
    return m
