"""nn.Modules built on :mod:`polaformer.ops`."""
from .pola_attention import PolaLinearAttention
from .polapp_attention import PacsLinearAttention, RoPE2d, RopeSoftmaxAttention
from .sr_attention import SpatialReductionAttention
from .window_attention import WindowAttention

__all__ = ["PolaLinearAttention", "PacsLinearAttention", "RoPE2d", "RopeSoftmaxAttention", "SpatialReductionAttention",
           "WindowAttention"]
