"""ftrain: a functional trainer on PyTorch with Zarr v3 checkpoints (public API re-exported here)."""

from ftrain import rng

__all__ = ["rng"]
__version__ = "0.1.0"
