"""Test-session set-up that must happen before any test module imports triton."""

import os

import torch

if not torch.cuda.is_available():
    # Triton kernels run interpreted on a CPU; the flag is read when a kernel is decorated, so it must
    # be set before the first `import moelab.kernels...` of any test module.
    os.environ.setdefault("TRITON_INTERPRET", "1")
