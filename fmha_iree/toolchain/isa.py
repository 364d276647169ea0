"""What a compiled GPU module's dumped executables say: the ISA report of a gfx module (IREE's
``*.rocmasm`` files) and the dispatches the runtime would refuse to load.

Occupancy is derived, not measured: waves per SIMD from the VGPR budget (CDNA gfx9: 512 unified
VGPR+AGPR entries per lane, allocated in granules of 8, at most 8 waves; RDNA gfx11/12 wave32: 1536
entries, granule 16, at most 16 waves) and from LDS (64 KiB per CU; 160 KiB on gfx950).
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["isa_report", "dispatch_limits", "MAX_BINDINGS", "MAX_CONSTANTS"]

# IREE's CUDA and HIP HALs refuse an executable whose dispatch binds more buffers or pushes more
# 32-bit constants than this (IREE_HAL_{CUDA,HIP}_MAX_DISPATCH_{BINDING,CONSTANT}_COUNT): the
# module compiles and then fails to load (H100: "binding_flags count 19 exceeds maximum of 16";
# docs/BENCHMARKS.md, "Windows in the tiles; one H100 session").
MAX_BINDINGS, MAX_CONSTANTS = 16, 64
_EXPORT = re.compile(r"hal\.executable\.export\s+public\s+@(\S+)[^\n]*?layout\(#hal\.pipeline\.layout<(.*?)>\)", re.S)

_FIELDS = ("vgpr_count", "agpr_count", "sgpr_count", "vgpr_spill_count", "sgpr_spill_count", "group_segment_fixed_size")


def _occupancy(arch: str, vgpr: int, agpr: int, lds: int, wg_waves: int) -> int:
    if arch.startswith("gfx9"):
        file, granule, cap, simds = 512, 8, 8, 4
    else:
        file, granule, cap, simds = 1536, 16, 16, 2
    regs = -(-vgpr // granule) * granule + -(-agpr // granule) * granule
    waves = min(cap, file // max(regs, 1))
    if lds:
        lds_cu = (160 if arch == "gfx950" else 64) * 1024
        wgs = lds_cu // lds
        waves = min(waves, wgs * max(wg_waves, 1) // simds) if wgs else 0
    return waves


def _kernels(text: str):
    """(name, metadata block, code) per kernel of one ``.rocmasm`` file."""
    meta = text[text.find("amdhsa.kernels:"):]
    for block in re.split(r"^  - \.", meta, flags=re.M)[1:]:
        m = re.search(r"^\s*\.name:\s*(\S+)", block, re.M)
        if not m:
            continue
        name = m.group(1).strip("'\"")
        begin = text.find(f"\n{name}:")
        end = text.find(".Lfunc_end", begin)
        yield name, "." + block, text[begin:end] if begin >= 0 else ""


def isa_report(dump_dir: str | Path, arch: str) -> list[dict]:
    """One entry per kernel: registers, spills, LDS bytes, matrix instructions, occupancy."""
    out = []
    for path in sorted(Path(dump_dir).glob("*.rocmasm")):
        for name, meta, code in _kernels(path.read_text(errors="replace")):
            entry = {"kernel": name}
            for f in _FIELDS:
                m = re.search(rf"^\s*\.{f}:\s*(\d+)", meta, re.M)
                entry[f] = int(m.group(1)) if m else 0
            m = re.search(r"^\s*\.wavefront_size:\s*(\d+)", meta, re.M)
            wave = int(m.group(1)) if m else (64 if arch.startswith("gfx9") else 32)
            m = re.search(r"^\s*\.max_flat_workgroup_size:\s*(\d+)", meta, re.M)
            wg = int(m.group(1)) if m else wave
            entry["wavefront_size"] = wave
            entry["workgroup_size"] = wg
            entry["mfma_count"] = len(re.findall(r"^\s*v_mfma", code, re.M))
            entry["wmma_count"] = len(re.findall(r"^\s*v_wmma", code, re.M))
            entry["occupancy_waves_per_simd"] = _occupancy(
                arch, entry["vgpr_count"], entry["agpr_count"], entry["group_segment_fixed_size"], -(-wg // wave)
            )
            out.append(entry)
    return out


def dispatch_limits(dump_dir: str | Path) -> list[str]:
    """The dumped executables' exports (``*.mlir`` in ``dump_dir``) that bind more than
    ``MAX_BINDINGS`` buffers or push more than ``MAX_CONSTANTS`` constants, as "name: N bindings, C
    constants"."""
    over = set()
    for path in Path(dump_dir).glob("*.mlir"):
        for m in _EXPORT.finditer(path.read_text(errors="replace")):
            layout = m.group(2)
            n = layout.count("#hal.pipeline.binding")
            c = re.search(r"constants\s*=\s*(\d+)", layout)
            k = int(c.group(1)) if c else 0
            if n > MAX_BINDINGS or k > MAX_CONSTANTS:
                over.add(f"{m.group(1)}: {n} bindings, {k} constants")
    return sorted(over)
