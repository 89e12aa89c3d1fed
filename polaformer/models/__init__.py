"""Model families, one file each; importing this package registers them with timm."""
from .deit import PolaDeiT
from .pola_dit import PolaDiT
from .pola_lm import PolaLM
from .pola_sr import PolaSR
from .polapp import PolaFormerPP
from .pvt import PolaPVT
from .pvt_v2 import PolaPVTv2
from .swin import PolaSwinTransformer

__all__ = ["PolaDeiT", "PolaDiT", "PolaFormerPP", "PolaLM", "PolaSR", "PolaPVT", "PolaPVTv2", "PolaSwinTransformer"]
