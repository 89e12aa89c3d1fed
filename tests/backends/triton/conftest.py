"""The Triton kernels' tests: without CUDA they run in Triton's interpreter on CPU tensors, which reads
TRITON_INTERPRET when a kernel is defined, so it is set here, before any test imports the kernels."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")


@pytest.fixture
def triton_backend():
    """Select the Triton kernels for one test, restoring the previous choice afterwards."""
    from polaformer.ops.dispatch import set_attention_backend

    previous = set_attention_backend("triton")
    yield
    set_attention_backend(previous)


@pytest.fixture
def device():
    """Where the kernels' inputs live: CUDA when present, else the CPU under the interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
