"""Compile targets and runtime devices: which IREE backend, which flags, which tile family.

A :class:`Target` is what a module is compiled for (``host``, ``gfx942``, ``sm_80``, ...); a device
string (``local-task``, ``hip://0``, ``cuda://0``) is where it runs. The GPU architecture of a
``hip``/``cuda`` device cannot be queried without the compiler, so it comes from the environment
(``FMHA_IREE_HIP_TARGET``, default gfx942; ``FMHA_IREE_CUDA_TARGET``, default sm_80) unless the
caller passes a :class:`Target`.

This module needs only the standard library, so deployed modules can use it without torch.
"""

from __future__ import annotations

import dataclasses
import os
import re

__all__ = ["Target", "resolve_device", "GFX_TARGETS"]

# Product names accepted for the ROCm targets.
_GFX_ALIASES = {
    "mi200": "gfx90a", "mi210": "gfx90a", "mi250": "gfx90a", "mi250x": "gfx90a",
    "mi300": "gfx942", "mi300x": "gfx942", "mi300a": "gfx942", "mi325x": "gfx942",
    "mi350x": "gfx950", "mi355x": "gfx950",
    "rx7900xtx": "gfx1100", "w7900": "gfx1100",
    "rx9070xt": "gfx1201", "r9700": "gfx1201",
}
GFX_TARGETS = ("gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1201")
_CPU_DRIVERS = ("local-task", "local-sync")


@dataclasses.dataclass(frozen=True)
class Target:
    """A compile target: ``backend`` is ``llvm-cpu``, ``rocm`` or ``cuda``; ``arch`` the chip."""

    backend: str
    arch: str

    @classmethod
    def from_name(cls, name: str) -> "Target":
        """``host``/``cpu``, a gfx name or product name (``mi300x``), or ``sm_NN``."""
        if not isinstance(name, str):
            raise TypeError(f"target must be a str, got {type(name).__name__}")
        n = name.strip().lower()
        if n in ("host", "cpu", "llvm-cpu"):
            return cls("llvm-cpu", "host")
        n = _GFX_ALIASES.get(n, n)
        if n in GFX_TARGETS:
            return cls("rocm", n)
        if re.fullmatch(r"sm_\d+a?", n):
            return cls("cuda", n)
        raise ValueError(
            f"target {name!r} is unknown: expected host, one of {', '.join(GFX_TARGETS)} "
            f"(or a product name such as mi300x), or sm_NN"
        )

    @property
    def name(self) -> str:
        return self.arch

    @property
    def family(self) -> str:
        """Tile-table family: ``cpu``, ``cdna`` (gfx9, MFMA, wave64), ``rdna`` (gfx11/12, WMMA,
        wave32) or ``cuda``."""
        if self.backend == "llvm-cpu":
            return "cpu"
        if self.backend == "cuda":
            return "cuda"
        return "cdna" if self.arch.startswith("gfx9") else "rdna"

    @property
    def driver(self) -> str:
        return {"llvm-cpu": "local-task", "rocm": "hip", "cuda": "cuda"}[self.backend]

    def compile_flags(self) -> list[str]:
        """iree-compile flags selecting this target."""
        if self.backend == "llvm-cpu":
            return [
                "--iree-hal-target-device=local",
                "--iree-hal-local-target-device-backends=llvm-cpu",
                "--iree-llvmcpu-target-cpu=host",
            ]
        if self.backend == "rocm":
            return ["--iree-hal-target-device=hip", f"--iree-rocm-target={self.arch}"]
        return ["--iree-hal-target-device=cuda", f"--iree-cuda-target={self.arch}"]


def resolve_device(device) -> tuple[str, Target]:
    """Normalize the ``device`` argument into (IREE device URI, compile target)."""
    if device is None:
        device = "local-task"
    if not isinstance(device, str):
        raise TypeError(f"device must be a str such as 'local-task', 'hip://0' or 'cuda://0', got {type(device).__name__}")
    d = device.strip()
    driver, sep, index = d.partition("://")
    # a device index is digits (the CPU drivers have one device, 0); IREE would take anything
    # here and fail only when the module is loaded, after the compile
    if sep and not (index.isdigit() and (driver not in _CPU_DRIVERS or int(index) == 0)):
        raise ValueError(f"device {device!r} is malformed: expected 'local-task', 'local-sync', 'hip://N' or 'cuda://N'")
    if driver in _CPU_DRIVERS:
        return d, Target("llvm-cpu", "host")
    if driver == "hip":
        return d, Target.from_name(os.environ.get("FMHA_IREE_HIP_TARGET", "gfx942"))
    if driver == "cuda":
        return d, Target.from_name(os.environ.get("FMHA_IREE_CUDA_TARGET", "sm_80"))
    raise ValueError(f"device {device!r} is unknown: expected 'local-task', 'local-sync', 'hip://N' or 'cuda://N'")
