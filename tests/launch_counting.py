"""Counting what one attention call asks of the device: Triton launches and torch operations that run a kernel
(allocations and views launch nothing and are not counted). Works on CUDA and in Triton's interpreter, where the
interpreter's own host copies are kept out of the count."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

# aten operations that allocate or re-view memory without running a kernel
_NO_KERNEL = {
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "view", "_unsafe_view", "as_strided",
    "expand", "transpose", "permute", "t", "slice", "select", "unsqueeze", "squeeze", "alias", "detach", "reshape",
    "unbind", "split", "chunk", "lift_fresh", "_reshape_alias", "diagonal", "unflatten", "flatten",
}


@dataclass
class Counts:
    launches: list[str] = field(default_factory=list)  # Triton kernels, by name
    operations: list[str] = field(default_factory=list)  # torch operations that run a kernel

    @property
    def total(self) -> int:
        return len(self.launches) + len(self.operations)


class _Recorder(TorchDispatchMode):
    def __init__(self, counts: Counts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in _NO_KERNEL:
            self.counts.operations.append(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting():
    """Yields a :class:`Counts` filled by the code run inside."""
    from triton.runtime import interpreter, jit

    counts = Counts()
    originals = {cls: cls.run for cls in (jit.JITFunction, interpreter.InterpretedFunction)}

    def counted(original):
        def run(self, *args, **kwargs):
            counts.launches.append(getattr(self, "__name__", None) or self.fn.__name__)
            with _disable_current_modes():  # the interpreter copies arguments on the host: not the op's work
                return original(self, *args, **kwargs)
        return run

    for cls, original in originals.items():
        cls.run = counted(original)
    try:
        with _Recorder(counts):
            yield counts
    finally:
        for cls, original in originals.items():
            cls.run = original
