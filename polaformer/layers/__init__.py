"""nn.Modules built on :mod:`polaformer.ops`, written with plain torch modules (speed-ups:
:func:`polaformer.accelerate`).

The Pola and PaCS token mixers for image grids and sequences, PolaFormer++'s RoPE softmax attention, Swin's
windows, PVT's spatial-reduction attention, and the baseline linear attentions compared against in the papers;
:data:`SEQUENCE_ATTENTIONS` (:mod:`.registry`) names the token mixers of the sequence models (LRA, LM, DiT).
"""
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
from .causal_attention import (
    CausalCache,
    EluCausalSelfAttention,
    PacsCausalSelfAttention,
    PolaCausalSelfAttention,
    SoftmaxCausalSelfAttention,
)
from .deformable import DeformableDepthwiseConv1d, DeformableDepthwiseConv2d
from .pacs_attention import PacsLinearAttention, RoPE2d, RopeSoftmaxAttention
from .pola_attention import LOCAL_BRANCHES, PolaLinearAttention
from .registry import SEQUENCE_ATTENTIONS, SequenceLayerAdapter, sequence_attentions
from .sequence_attention import GATE_INITS, PacsSequenceAttention, PolaMultiheadAttention, PolaSequenceAttention
from .sr_attention import SpatialReductionAttention
from .window_attention import WindowAttention

__all__ = ["GATE_INITS", "LOCAL_BRANCHES", "CausalCache", "CosformerAttention", "DeformableDepthwiseConv1d",
           "DeformableDepthwiseConv2d", "EluCausalSelfAttention", "FocusedLinearAttention", "KernelizedAttention",
           "LinearAttention", "PacsCausalSelfAttention", "PolaCausalSelfAttention", "SoftmaxCausalSelfAttention",
           "LinformerAttention", "NystromAttention", "PacsLinearAttention", "PacsSequenceAttention",
           "PerformerAttention", "PolaLinearAttention", "PolaMultiheadAttention", "PolaSequenceAttention",
           "QKVAttention", "RoPE2d", "RopeSoftmaxAttention", "SEQUENCE_ATTENTIONS", "SequenceLayerAdapter",
           "SkyformerAttention", "SoftmaxAttention", "SpatialReductionAttention", "WindowAttention", "iterative_pinv",
           "orthogonal_gaussian_features", "sequence_attentions"]
