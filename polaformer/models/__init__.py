"""Model families, one file each; importing this package registers them with timm."""
from .deit import PolaDeiT
from .pvt import PolaPVT
from .pvt_v2 import PolaPVTv2

__all__ = ["PolaDeiT", "PolaPVT", "PolaPVTv2"]
