"""PolaFormer and PolaFormer++ (polarity-aware linear attention) for PyTorch and timm.

``import polaformer.models`` registers the models with timm; :func:`load_checkpoint` loads
weights (the authors' released checkpoints included) into a model without running code
from the file; :func:`accelerate` swaps a model's modules for their fused CPU versions.

The ``polaformer`` command imports the package without torch or timm (the three names load them on first
use), so it answers ``--help`` and argument errors at once; any other import of the package loads them at once,
which registers the models with timm as before.
"""
import sys

from ._startup import is_command_line, prepare_environment

if is_command_line():  # before torch (which imports triton) is imported by the command
    prepare_environment(sys.argv[1:])

__all__ = ["LoadResult", "accelerate", "load_checkpoint"]


def __getattr__(name: str):
    if name == "accelerate":
        from .acceleration import accelerate as value
    elif name in ("LoadResult", "load_checkpoint"):
        from . import checkpoint

        value = getattr(checkpoint, name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if not is_command_line():  # a library import: the models registered with timm, as ``import polaformer`` always did
    from . import models  # noqa: F401
    from .acceleration import accelerate
    from .checkpoint import LoadResult, load_checkpoint
