"""Where a group of query rows looks: CK's visible key range, cut into an interior and two edges.

Row ``s`` sees keys ``lo(s) <= j < hi(s)`` with ``lo(s) = clamp(s - y + 1, 0, Sk)`` and
``hi(s) = clamp(s + x, 0, Sk)`` (CK's ``(y, x)`` coordinates; both non-decreasing in ``s``). For
the rows ``a .. b`` of a group:

* interior ``[lo(b), lo(b) + n*L)``, ``n = floor(max(hi(a) - lo(b), 0) / L)``: keys every row of
  the group sees, a whole number of ``L``-key columns (read in place, no mask);
* left edge ``[lo(a), lo(b))`` and right edge ``[lo(b) + n*L, max(hi(b), lo(b) + n*L))``: the rest
  of the union ``[lo(a), hi(b))``, computed with a mask. Their widths are at most ``b - a`` and
  ``b - a + L - 1``.

An edge is computed over an aligned window (``edge_window``): ``round_up(width, unit)`` keys from
``max(0, min(lo, limit - that))``, so that its op's key count is a proven multiple of the tile
(IREE then drops the per-tile bounds checks, measured faster on the H200: docs/BENCHMARKS.md, "How
the constants were chosen"); keys of the window outside the edge are masked out. A window needs
``limit`` (the keys that can be read) of at least its width.

Keys outside the union are never read: CK's ``GetTileRangeAlongX`` at the group's granularity.
The same formulas run on the host (the exported function's index arithmetic, per group) and on
the device (the mask generator, per element), so the two agree by construction.

A ragged frame (``fwd_ragged``: each batch its own lengths and coordinates) cuts with two sets of
coordinates (``Coords``): the interior uses the tightest (the smallest ``y`` and ``x``, keys below
the smallest limit ``khi``), so that it holds keys every valid row of every batch sees; the union
uses the loosest (the largest ``y``, ``x`` and ``khi``), so that it holds every key some valid row
sees. The edges, masked per batch, cover the difference.
"""

from __future__ import annotations

import dataclasses

from .ir import Fn

__all__ = ["Bounds", "Coords", "group_bounds", "row_lo", "row_hi", "edge_window", "PREFIX_STEPS", "prefix_entries"]

# a ragged frame's entries ordered longest first: how many of them have rows at or past row
# i * U, for i < PREFIX_STEPS (fwd_ragged's scalars nb0 ..; frames.Frame.prefix)
from ...problem.abi import PREFIX_STEPS


@dataclasses.dataclass(frozen=True)
class Coords:
    """SSA names (index) of the coordinates a cut uses: interior ``(y, x, khi)`` and union
    ``(y_u, x_u, khi_u)``; ``khi`` None: no key limit below Sk (one batch-wide mask)."""

    y: str
    x: str
    y_u: str
    x_u: str
    khi: str | None = None
    khi_u: str | None = None

    @classmethod
    def uniform(cls, y: str, x: str) -> "Coords":
        return cls(y, x, y, x)


@dataclasses.dataclass(frozen=True)
class Bounds:
    """SSA names (index) of one group's ranges."""

    first: str  # a: the group's first row
    last: str  # b: its last real row
    int_lo: str
    n_cols: str  # n: interior columns of L keys
    int_hi: str
    left_lo: str
    left_hi: str
    right_lo: str
    right_hi: str


def row_lo(fn: Fn, s: str, y: str, sk: str) -> str:
    return fn.clamp(fn.add(fn.sub(s, y), 1), 0, sk)


def row_hi(fn: Fn, s: str, x: str, sk: str) -> str:
    return fn.clamp(fn.add(s, x), 0, sk)


def group_bounds(fn: Fn, *, g, rows: str, sq: str, sk: str, co: Coords, cols: int) -> Bounds:
    """Ranges of group ``g`` (an index value or int) of ``rows`` rows; needs ``g * rows < sq``."""
    a = fn.mul(g, rows)
    b = fn.sub(fn.min(fn.add(a, rows), sq), 1)
    lo_a, lo_b = row_lo(fn, a, co.y_u, sk), row_lo(fn, b, co.y, sk)
    hi_a, hi_b = row_hi(fn, a, co.x, sk), row_hi(fn, b, co.x_u, sk)
    if co.khi is not None:
        hi_a, hi_b = fn.min(hi_a, co.khi), fn.min(hi_b, co.khi_u)
    span = fn.max(fn.sub(hi_a, lo_b), 0)
    n = fn.floordiv(span, cols)
    int_hi = fn.add(lo_b, fn.mul(n, cols))
    return Bounds(first=a, last=b, int_lo=lo_b, n_cols=n, int_hi=int_hi, left_lo=lo_a, left_hi=lo_b,
                  right_lo=int_hi, right_hi=fn.max(hi_b, int_hi))


def edge_window(fn: Fn, lo, hi, limit, unit: int) -> tuple[str, str]:
    """(start, width) of the aligned window over the edge ``[lo, hi)``: ``width = round_up(hi - lo,
    unit)`` keys from ``max(0, min(lo, limit - width))`` (valid when ``width <= limit``)."""
    width = fn.round_up(fn.sub(hi, lo), unit)
    return fn.max(fn.min(lo, fn.sub(limit, width)), 0), width


def prefix_entries(fn: Fn, row, unit: str, counts: list[str], b: str) -> str:
    """The leading batch entries a group whose first row is ``row`` computes: ``counts[row //
    unit]`` (the last count past the table), at least 1 (so no op is empty) and at most ``b``."""
    i = fn.floordiv(row, unit)
    n = counts[0]
    for j, count in enumerate(counts[1:], 1):
        n = fn.select(fn.cmp("sge", i, j), count, n)
    return fn.bounded(fn.clamp(n, 1, b))
