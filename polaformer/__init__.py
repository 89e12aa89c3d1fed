"""PolaFormer and PolaFormer++ (polarity-aware linear attention) for PyTorch and timm.

``import polaformer.models`` registers the models with timm; :func:`load_checkpoint` loads
weights (the authors' released checkpoints included) into a model without running code
from the file; :func:`accelerate` swaps a model's modules for their fused CPU versions.
"""
import sys

from ._startup import interrupt_exits, is_command_line, prepare_environment

if is_command_line():  # before torch (which imports triton) is imported below
    prepare_environment(sys.argv[1:])

with interrupt_exits(is_command_line()):  # these imports take seconds: Ctrl-C during them is one line
    from .backends.cpu.accelerate import accelerate
    from .checkpoint import LoadResult, load_checkpoint

__all__ = ["LoadResult", "accelerate", "load_checkpoint"]
