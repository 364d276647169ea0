"""fmha_iree: Composable Kernel's ck_tile FMHA forward, as tiled torch graphs compiled through IREE."""

from .api import cache_stats, fmha_fwd, fmha_fwd_varlen, to_device
from .mask import Mask
from .runtime import DeviceTensor
from .tiles import TileConfig

__all__ = ["fmha_fwd", "fmha_fwd_varlen", "to_device", "DeviceTensor", "Mask", "TileConfig", "cache_stats"]
__version__ = "0.1.0"
