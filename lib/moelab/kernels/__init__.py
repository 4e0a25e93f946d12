"""Triton kernels: fused routing (routing.py), pair layout without host sync (layout.py), padded
expert row ops (experts.py). Dispatch lives in moelab.routing / moelab.experts."""

import contextlib

import torch


def on_device_of(t: torch.Tensor):
    """Context that makes t's GPU current: Triton launches on the current device, not the tensor's,
    which matters once a model is split over several GPUs (device_map)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
