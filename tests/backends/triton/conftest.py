"""The Triton kernels' tests. Without CUDA they run in Triton's interpreter on CPU tensors: TRITON_INTERPRET=1
must be set before the kernels' modules are imported, which polaformer does lazily, on the first call."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")


@pytest.fixture
def triton_backend():
    """Selects the Triton attention kernels for one test and restores the previous choice."""
    from polaformer.ops.dispatch import set_attention_backend

    previous = set_attention_backend("triton")
    yield
    set_attention_backend(previous)
