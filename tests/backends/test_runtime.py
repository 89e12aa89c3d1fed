import sys

import pytest

from polaformer.runtime import tune_cpu_allocator


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc tuning is Linux-only")
def test_allocator_tuning_applies_once_and_torch_still_works():
    import torch

    assert tune_cpu_allocator() is True
    assert tune_cpu_allocator() is True  # idempotent
    x = torch.ones(4 << 20)  # 16 MB: above glibc's default mmap threshold
    del x
    assert torch.ones(4 << 20).sum().item() == 4 << 20
