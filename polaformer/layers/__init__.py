"""nn.Modules built on :mod:`polaformer.ops`, written with plain torch modules (speed-ups: :func:`polaformer.accelerate`)."""
from .pola_attention import PolaLinearAttention
from .polapp_attention import PacsLinearAttention, RoPE2d, RopeSoftmaxAttention
from .sequence_attention import GATE_INITS, PacsSequenceAttention, PolaMultiheadAttention, PolaSequenceAttention
from .sr_attention import SpatialReductionAttention
from .window_attention import WindowAttention

__all__ = ["GATE_INITS", "PacsLinearAttention", "PacsSequenceAttention", "PolaLinearAttention", "PolaMultiheadAttention",
           "PolaSequenceAttention", "RoPE2d", "RopeSoftmaxAttention", "SpatialReductionAttention", "WindowAttention"]
