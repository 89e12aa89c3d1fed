"""Model families, one file each; importing this package registers them with timm."""
from .deit import PolaDeiT
from .pvt import PolaPVT

__all__ = ["PolaDeiT", "PolaPVT"]
