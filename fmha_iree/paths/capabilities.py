"""What a compiled module can run, read once from its manifest's ``capabilities`` record: a frozen
object the paths ask instead of probing the module's functions.

The record is written at compile time (``entries.capabilities``) from the same parameters the
module's source is rendered from; :meth:`Capabilities.from_record` reads it back and checks it
against the functions the loaded module exports. Needs nothing but the standard library.
"""

from __future__ import annotations

import dataclasses

from ..problem.tiles import TileConfig

__all__ = ["Capabilities", "DenseCaps", "TilesCaps"]


@dataclasses.dataclass(frozen=True)
class DenseCaps:
    """The one-call entries of fixed or aligned lengths (``paths.compiled_in``): lengths are
    multiples of ``align``; ``seqlens`` the lengths compiled in (Sq == Sk == S); ``causal_o`` those
    with a causal out-only entry; ``tiled`` GPU templates (q / k / v read as blocks of ``align`` rows) rather than the CPU's
    row blocks; ``dynamic`` an aligned ``dense`` entry for any multiple of ``align``; ``batch`` /
    ``kv_heads`` what the CPU's compiled-in entries are fixed to (0: any)."""

    align: int
    seqlens: tuple[int, ...] = ()
    causal_o: tuple[int, ...] = ()
    tiled: bool = True
    dynamic: bool = True
    batch: int = 0
    kv_heads: int = 0


@dataclasses.dataclass(frozen=True)
class TilesCaps:
    """``fwd_tiles``' static sizes (``paths.tiles``): state rows per tile, the group they hold, the
    edge's key bound and the interior's key step."""

    rows: int
    group: int
    ew: int
    step: int
    short: "TilesCaps | None" = None  # ``fwd_tiles_short*``'s (ALiBi modules: decode on 16-row tiles)

    @property
    def positions(self) -> int:
        """Query positions per tile."""
        return self.rows // self.group


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """A module's capabilities. ``formulation``: ``"gpu"`` (the fused kernels: ``fwd``, the tiles,
    the frames) or ``"cpu"`` (the CPU's torch graphs and loops: ``rows``, ``units``, the group-mode
    tables); ``family`` the target family (``cpu``, ``cuda``, ``cdna3`` ...), which sizes the
    tile plan; ``entries`` the functions the module exports."""

    module: str
    formulation: str
    family: str
    layout: str
    dtype: str
    group: int
    dq: int
    dv: int
    tiles: TileConfig
    entries: frozenset
    unit_rows: int = 0
    dense: DenseCaps | None = None
    key_tiles: TilesCaps | None = None
    alibi: bool = False  # the ALiBi slopes are an argument of its paths (and a call must give them)
    bias: bool = False  # an elementwise bias is an argument of its paths (likewise)

    def has(self, *names: str) -> bool:
        """Whether the module exports every one of ``names``."""
        return all(n in self.entries for n in names)

    def missing(self, *names: str) -> str | None:
        """A reason naming those of ``names`` the module lacks, or None."""
        gone = [n for n in names if n not in self.entries]
        return f"the module has no {', '.join(gone)}" if gone else None

    @property
    def typed_bf16(self) -> bool:
        """Whether bf16 arguments are typed bf16 (the GPU formulation's MLIR) rather than int16."""
        return self.formulation == "gpu"

    @classmethod
    def from_record(cls, record: dict, functions=None) -> "Capabilities":
        """Read a manifest's ``capabilities`` record; ``functions`` (the loaded module's exports),
        where given, must hold every entry the record names (ValueError naming the lacking ones)."""
        entries = frozenset(record["entries"])
        if functions is not None:
            gone = sorted(entries - set(functions))
            if gone:
                raise ValueError(f"module {record['module']!r} lacks the entry points its manifest lists: {gone}")
        d, t = record.get("dense"), record.get("key_tiles")
        dense = None if d is None else DenseCaps(
            int(d["align"]), tuple(int(s) for s in d["seqlens"]), tuple(int(s) for s in d["causal_o"]),
            bool(d["tiled"]), bool(d["dynamic"]),
            int(d.get("batch", 0)), int(d.get("kv_heads", 0)))
        key_tiles = None if t is None else TilesCaps(
            int(t["rows"]), int(t["group"]), int(t["ew"]), int(t["step"]),
            TilesCaps(int(t["short_rows"]), int(t["group"]), int(t["short_ew"]), int(t["step"])) if "short_rows" in t else None)
        ck = record["tiles"]
        tiles = TileConfig(ck["kM0"], ck["kN0"], ck["kK0"], ck["kN1"], ck["kK1"], kv_chunk=ck["kv_chunk"])
        return cls(str(record["module"]), str(record["formulation"]), str(record["family"]), str(record["layout"]),
                   str(record["dtype"]), int(record["group"]), int(record["dq"]), int(record["dv"]), tiles, entries,
                   int(record.get("unit_rows", 0)), dense, key_tiles, bool(record.get("alibi", False)),
                   bool(record.get("bias", False)))
