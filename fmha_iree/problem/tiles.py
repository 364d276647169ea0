"""Tile configurations under CK's names, and the default table per target family.

CK's block tile is ``kM0 x kN0 x kK0 x kN1 x kK1`` (reference doc, "Tiles"). Here it maps to:

* ``m0`` (kM0): query rows of a work unit, and IREE's workgroup M on GPU targets.
* ``n0`` (kN0): keys per inner step: IREE's reduction tile over keys (K2) on GPU targets, and the
  key granularity at which fully masked blocks are skipped.
* ``n1`` (kN1): V head-dim columns per workgroup: IREE's workgroup N on GPU targets.
* ``k0`` / ``k1`` (kK0 / kK1): head-dim and key chunks of the two products. IREE's GPU codegen fixes
  them through the matrix intrinsic it picks (16 for MFMA/WMMA f16 16x16x16); they are kept for the
  record and validated as multiples of that.
* ``kv_chunk``: keys per work unit of the host plan (a multiple of ``n0``). Larger chunks mean fewer
  launches, smaller ones finer skipping of masked work.

On the CPU (llvm-cpu) the tile shapes the work units (``m0`` rows x ``kv_chunk`` keys per unit); IREE
picks its own vector tiles inside them.

This module needs only the standard library, so deployed modules can use it without torch.
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["TileConfig", "CPU_VARLEN_ROWS", "CPU_WAVE_ROWS", "CPU_WAVE_KEYS", "varlen_rows", "default_tiles", "parse_tiles", "tuned_lowering", "TILED_HEAD_DIMS", "compute_head_dim"]


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """A block tile under CK's names (see module docstring for what each becomes in IREE)."""

    m0: int = 128
    n0: int = 128
    k0: int = 32
    n1: int = 128
    k1: int = 32
    kv_chunk: int | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            val = getattr(self, f.name)
            if val is None and f.name == "kv_chunk":
                continue
            if isinstance(val, bool) or not isinstance(val, int):
                raise TypeError(f"tiles.{f.name} must be an int, got {type(val).__name__}")
            if val <= 0:
                raise ValueError(f"tiles.{f.name} must be positive, got {val}")
        if self.kv_chunk is None:
            object.__setattr__(self, "kv_chunk", self.n0)
        if self.kv_chunk % self.n0:
            raise ValueError(f"tiles.kv_chunk ({self.kv_chunk}) must be a multiple of tiles.n0 ({self.n0})")

    @property
    def ck_name(self) -> str:
        """CK's ``bm0xbn0xbk0xbn1xbk1`` spelling."""
        return f"{self.m0}x{self.n0}x{self.k0}x{self.n1}x{self.k1}"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def parse_tiles(text: str) -> TileConfig:
    """Parse ``128x128x32x128x32`` (optionally ``...:chunk`` for ``kv_chunk``)."""
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)x(\d+)x(\d+)(?::(\d+))?", text.strip())
    if not m:
        raise ValueError(f"tiles {text!r}: expected m0xn0xk0xn1xk1 such as 128x128x32x128x32")
    vals = [int(g) for g in m.groups()[:5]]
    chunk = int(m.group(6)) if m.group(6) else None
    return TileConfig(*vals, kv_chunk=chunk)


# Defaults per target family and head dim.
# CPU: work units of 256 rows x 512 keys (with plan.SCORE_BUDGET's 4 Mi scores per step call):
# on the dev CPU they beat 128x128, 256x256 and 256x1024 on every row but the chunked prefill
# (larger units cut the per-unit gathers and state merges; docs/BENCHMARKS.md, "CPU: the 2-core
# x86_64 development machine"). Re-swept for `units` (docs/tried.md, "Unit shapes for `units`"):
# 256-key chunks slower everywhere, 512-row tiles slower on the chunked prefill.
_CPU = {d: TileConfig(256, 128, 32, 128, 32, kv_chunk=512) for d in (32, 64, 96, 128, 192, 256)}
# Group mode's ``units_varlen`` tiles hold at most this many rows (``m0`` above it): a sequence's last
# tile and its diagonal waste less: faster than 256 rows on the dev CPU for the 16-sequence prefill,
# the same on one long sequence (docs/BENCHMARKS.md, "CPU: the 2-core x86_64 development machine").
CPU_VARLEN_ROWS = 128
# Group mode's ``waves_varlen`` (short and middling sequences: every sequence's row tiles advance
# together, a few large dispatches a call): slots of 64 rows, key chunks of 64, faster than 128 x 128
# on the dev CPU for short and middling sequences; longer ones keep ``units_varlen``
# (``cpu_calls.WAVE_MAX_ROWS``; docs/tried.md, "Group mode's tiles as waves: how `waves_varlen`
# reached its form").
from .abi import CPU_WAVE_KEYS, CPU_WAVE_ROWS

# The CPU step's attention op (``mlir_templates.step``, K gathered transposed): workgroups of 64
# query rows of one unit and head, vector tiles of 4 rows x kN0 (128) keys: the fastest of the
# workgroup / vector shapes timed on the dev CPU; K as [keys, Dq] (each score reduced across a
# vector of Dq) was several times slower (docs/tried.md, "IREE's attention op on llvm-cpu").
CPU_STEP_LOWERING = {"backend": "cpu", "workgroup_m": 64, "vector_m": 4}
# Elements of one vector tile (vector rows x keys x head dim) the CPU step allows; wider head dims
# take fewer keys per step. At d256 with 128 keys (4x the elements) the step's module segfaulted
# (tests/test_dtypes.py f16 d256; its vectors are spilled to the stack).
CPU_STEP_VECTOR = 4 * 128 * 64

# CK's gfx9 fp16/bf16 table (reference doc "Tiles"), kept for the record (not a default). Through
# IREE 3.13's VectorDistribute its kM0=128 / kN0=128 step does not fit: at d128 it asks for 96 KiB
# of LDS (limit 64 KiB on gfx90a/gfx942, seen compiling for gfx942).
CK_GFX9 = {
    32: TileConfig(128, 64, 16, 32, 32),
    64: TileConfig(128, 64, 32, 64, 32),
    96: TileConfig(128, 128, 32, 128, 32),
    128: TileConfig(128, 128, 32, 128, 32),
    192: TileConfig(128, 128, 32, 128, 32),
    256: TileConfig(128, 128, 32, 256, 32),
}


def _gpu(n0_by_d: dict) -> dict:
    # kM0 = 64 rows per workgroup, kN1 = the whole Dv, kK0 = kK1 = 16 (the K of the 16x16x16
    # MFMA/WMMA or 16x8x16 MMA intrinsic IREE uses), work units of 256 keys. Compile checks with
    # iree-compile 3.13 (gfx942 f16 d128, kN0 = 64): 108 VGPRs, 43 KB LDS, no spills;
    # kN0 = 32 at Dv = 256 keeps LDS under 64 KiB (40 KB, 236 VGPRs, no spills). The H200 tile sweep
    # (docs/tried.md, "More tiles for one `online_attention`") found M64 / K2=32 fastest for IREE's
    # attention op at d128.
    return {d: TileConfig(64, n0, 16, d, 16, kv_chunk=256) for d, n0 in n0_by_d.items()}


_GPU = _gpu({32: 64, 64: 64, 96: 64, 128: 64, 192: 32, 256: 32})


def _tuned(name: str) -> dict:
    """Winners of the H200 kernel sweeps (written with the figures that chose them):
    ``{(hdim, dtype): entry}``."""
    import json
    from pathlib import Path

    try:
        entries = json.loads((Path(__file__).resolve().parent / name).read_text())
    except OSError:
        return {}
    return {(e["hdim"], e["dtype"]): e for e in entries}


def _tile_of(e: dict) -> "TileConfig":
    low = e["lowering"]
    return TileConfig(low["workgroup_m"], low["reduction_k2"], 16, e["hdim"], 16, kv_chunk=256)


_TUNED_CUDA = _tuned("tuned_cuda.json")

# CUDA: the H200 sweep (tuned_cuda.json, with its figures; kernel times of one fused attention op
# over B*H x 4096 x D, with exp2 as ex2.approx): 32 query rows per warp won where it fits the
# registers: d64 M128/K2=64 with 4 warps; d128 f16 M256/K2=32 with 8 warps, d128 bf16 M128/K2=64
# with 4 warps (M256 and the earlier M64/K2=32 winner slower); d256 M128/K2=32 with 8 warps
# (docs/BENCHMARKS.md, "How the constants were chosen"). The f16 entry is the head dim's default;
# other dtypes override it where they have an entry.
_CUDA = {**_GPU, **{d: _tile_of(e) for (d, dt), e in _TUNED_CUDA.items() if dt == "f16"}}
_CUDA_DTYPE = {(d, dt): _tile_of(e) for (d, dt), e in _TUNED_CUDA.items() if dt != "f16"}


def tuned_lowering(family: str, tiles: "TileConfig", dv: int) -> dict:
    """The warp layout (``subgroups_m``) and ``transpose_v`` the sweep chose with these tiles, or {}
    when ``tiles`` are not tuned ones (the caller then derives its own)."""
    if family != "cuda":
        return {}
    for (d, _), e in _TUNED_CUDA.items():
        if d == dv and (e["lowering"]["workgroup_m"], e["lowering"]["reduction_k2"]) == (tiles.m0, tiles.n0):
            return {k: e["lowering"][k] for k in ("subgroups_m", "transpose_v") if k in e["lowering"]}
    return {}


_TABLES = {"cpu": _CPU, "cdna": _GPU, "rdna": _GPU, "cuda": _CUDA}

# gfx1100 (RDNA3, wave32, 256 VGPRs): at Dv >= 128 the family default spills VGPRs; these do not
# (iree-compile 3.13: d128 f16/bf16 230/241 VGPRs, d256 f16 220 VGPRs, 0 spills; docs/BENCHMARKS.md,
# "Default config of every target").
# bf16 at d256 spilled in every config tried and is refused (not_supported_reasons).
_ARCH_OVERRIDES = {
    "gfx1100": {128: TileConfig(32, 32, 16, 64, 16, kv_chunk=256), 256: TileConfig(16, 16, 16, 32, 16, kv_chunk=256)},
}


# Head dims with tile configs of their own; ``fwd`` runs any other one zero-padded up to the next
# (CK's kK0max: its d96 kernels compute 128 wide). IREE 3.13 derives no MFMA / WMMA layout for an
# attention op at 96 or 192 ("failed to derive layout for promoted read-like op" for every tile,
# subgroup and promotion choice tried on gfx942, docs/tried.md, "Explicit attention configs at head
# dims 96 and 192"), so those took IREE's own config.
TILED_HEAD_DIMS = (32, 64, 128, 256)


def compute_head_dim(d: int) -> int:
    """The head dim ``fwd`` computes a head dim ``d`` at: ``d`` itself, or the next tiled one up."""
    return next((t for t in TILED_HEAD_DIMS if t >= d), d)


def default_tiles(family: str, dq: int, dv: int, arch: str = "", dtype: str = "") -> TileConfig:
    """The default tile for a target family (``cpu``, ``cdna``, ``rdna``, ``cuda``), chip, head
    dims and (where a table has per-dtype entries) dtype."""
    d = max(dq, dv)
    over = _ARCH_OVERRIDES.get(arch, {})
    if d in over:
        return over[d]
    if family == "cuda" and (d, dtype) in _CUDA_DTYPE and dv == d:
        return _CUDA_DTYPE[(d, dtype)]
    table = _TABLES[family]
    key = min((k for k in table if k >= d), default=max(table))
    tiles = table[key]
    if family != "cpu" and tiles.n1 != dv:
        tiles = TileConfig(tiles.m0, tiles.n0, tiles.k0, dv, tiles.k1, kv_chunk=tiles.kv_chunk)
    return tiles


# Shared memory per workgroup IREE 3.13 allows per target (its target descriptions,
# ``max_workgroup_memory_bytes``, read from dumped configured IR).
LDS_LIMIT = {"gfx90a": 65536, "gfx942": 65536, "gfx950": 163840, "gfx1100": 65536, "gfx1201": 65536}
SMEM_LIMIT_CUDA = 166912
MMA_K = 16  # K of the 16x16x16 MFMA/WMMA and 16x8x16 MMA intrinsics used


def lds_estimate(tiles: TileConfig, dq: int, dv: int, elem_bytes: int) -> int:
    """Shared memory of the fused GPU step: K and V tiles (kN0 x (Dq + Dv)) plus the P tile
    (kM0 x kN0). Matches IREE 3.13 on gfx942 f16 within ~10% (d128: M64/K2=32 22 KB, M64/K2=64
    43 KB, M128/K2=64 52 KB, M128/K2=128 98 KB)."""
    return (tiles.n0 * (dq + dv) + tiles.m0 * tiles.n0) * elem_bytes


def iree_picks_config(family: str, dtype: str, dv: int, arch: str = "", dq: int | None = None) -> bool:
    """GPU problems whose lowering is left to IREE (the tile then only shapes the work units).
    Compile checks with iree-compile 3.13 (scripts/compile_matrix.py): f32 (no
    matrix-intrinsic config is set up here); head dims 96 / 192 (explicit configs fail with "failed
    to derive layout for promoted read-like op"); gfx1201 with Dv >= 256 (explicit configs spilled,
    IREE's own did not)."""
    if family == "cpu":
        return False
    dq = dv if dq is None else dq
    if dtype == "f32" or dq in (96, 192) or dv in (96, 192):
        return True
    return family == "rdna" and arch != "gfx1100" and dv >= 256


def not_supported_reasons(tiles: TileConfig, family: str, arch: str, dq: int, dv: int, dtype: str) -> list[str]:
    """Why ``tiles`` cannot work for this target and problem (empty when it can)."""
    why = []
    if family == "cpu":
        if tiles.m0 > 1024 or tiles.kv_chunk > 4096:
            why.append(f"tiles.m0 {tiles.m0} / kv_chunk {tiles.kv_chunk} too large for the CPU (m0 <= 1024, kv_chunk <= 4096)")
        return why
    for name in ("m0", "n0", "n1", "k0", "k1"):
        if getattr(tiles, name) % MMA_K:
            why.append(f"tiles.{name} = {getattr(tiles, name)} is not a multiple of the matrix intrinsic's 16")
    if dv % tiles.n1:
        why.append(f"tiles.n1 = {tiles.n1} does not divide the V head dim {dv}")
    if dq % MMA_K or dv % MMA_K:
        why.append(f"head dims {dq}/{dv} must be multiples of 16 on GPU targets")
    if iree_picks_config(family, dtype, dv, arch, dq):
        return why
    limit = SMEM_LIMIT_CUDA if family == "cuda" else LDS_LIMIT.get(arch, 65536)
    need = lds_estimate(tiles, dq, dv, 4 if dtype == "f32" else 2)
    if need > limit:
        why.append(f"tiles {tiles.ck_name} need about {need} bytes of shared memory; {arch} has {limit}")
    return why


def check_tiles_for(tiles: TileConfig, family: str, arch: str, dq: int, dv: int, dtype: str) -> TileConfig:
    why = not_supported_reasons(tiles, family, arch, dq, dv, dtype)
    if why:
        raise ValueError("tiles: " + "; ".join(why))
    return tiles


def varlen_rows(tiles: TileConfig) -> int:
    """The rows of a ``units_varlen`` tile for a module of ``tiles`` (``CPU_VARLEN_ROWS`` at most)."""
    return min(tiles.m0, CPU_VARLEN_ROWS)
