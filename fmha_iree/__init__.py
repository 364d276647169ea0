"""fmha_iree: Composable Kernel's ck_tile FMHA forward, as tiled torch graphs compiled through IREE.

The public names below load on first use, so importing a lower layer alone (``fmha_iree.runtime``,
``fmha_iree.deploy`` on a machine with only ``iree-base-runtime`` and numpy) pulls in nothing above
it.
"""

import importlib

__all__ = ["fmha_fwd", "fmha_fwd_varlen", "route", "to_device", "load", "DeployedFmha", "DeviceTensor", "Mask",
           "TileConfig", "cache_stats", "clear_memory_caches", "register_transformers", "context_parallel_attention",
           "sdpa"]
__version__ = "0.1.0"

_WHERE = {
    "fmha_fwd": "api", "fmha_fwd_varlen": "api", "route": "api", "to_device": "api", "cache_stats": "api",
    "clear_memory_caches": "api", "load": "deploy", "DeployedFmha": "deploy", "DeviceTensor": "runtime.device",
    "Mask": "problem.mask", "TileConfig": "problem.tiles", "register_transformers": "integrations.hf",
    "context_parallel_attention": "integrations.distributed", "sdpa": "integrations.torch_ops",
}


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'fmha_iree' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
