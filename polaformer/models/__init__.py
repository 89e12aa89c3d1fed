"""Model families, one file each; importing this package registers them with timm."""
from .deit import PolaDeiT

__all__ = ["PolaDeiT"]
