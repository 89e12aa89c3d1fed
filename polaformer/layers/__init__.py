"""nn.Modules built on :mod:`polaformer.ops`."""
from .linear import Linear, Mlp
from .pola_attention import PolaLinearAttention, branch_and_gate
from .polapp_attention import PacsLinearAttention, RoPE2d, RopeSoftmaxAttention
from .sequence_attention import GATE_INITS, PacsSequenceAttention, PolaMultiheadAttention, PolaSequenceAttention
from .sr_attention import SpatialReductionAttention
from .window_attention import WindowAttention

__all__ = ["GATE_INITS", "Linear", "Mlp", "PacsLinearAttention", "PacsSequenceAttention", "PolaLinearAttention", "PolaMultiheadAttention",
           "PolaSequenceAttention", "RoPE2d", "RopeSoftmaxAttention", "SpatialReductionAttention", "WindowAttention",
           "branch_and_gate"]
from .baseline_attention import (
    CosformerAttention,
    FocusedLinearAttention,
    KernelizedAttention,
    LinearAttention,
    LinformerAttention,
    NystromAttention,
    PerformerAttention,
    QKVAttention,
    SkyformerAttention,
    SoftmaxAttention,
    iterative_pinv,
    orthogonal_gaussian_features,
)

__all__ += ["CosformerAttention", "FocusedLinearAttention", "KernelizedAttention", "LinearAttention",
            "LinformerAttention", "NystromAttention", "PerformerAttention", "QKVAttention", "SkyformerAttention",
            "SoftmaxAttention", "iterative_pinv", "orthogonal_gaussian_features"]
