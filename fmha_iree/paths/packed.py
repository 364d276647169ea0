"""The decode path: ``fwd_packed`` and its paged forms (``kernels.packed``), split-KV pieces.

A decode-shaped problem (at most ``PIECE_ROWS`` query rows per sequence, the G query heads of a
KV head as rows) reads its keys where they lie, as pieces of ``W`` keys; each piece holds the
sequences whose keys it covers in its slots, and a merge joins each sequence's pieces. Three
forms, by where the keys are: ``fwd_packed`` (group mode's packed keys, read in place),
``fwd_packed_pages`` (a paged cache whose pages are a multiple of ``PAGE_ROWS`` rows, read in
place), ``fwd_packed_paged`` (keys with gaps or small pages, gathered as pages first).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..problem.abi import PAGE_GROUP, PAGE_ROWS, PIECE_ROWS
from ..problem.plan import runs
from .base import Problem, Refused
from .capabilities import Capabilities
from .frame import Frame, TableCall, frame_keys, problem_frame
from .policy import GATHER_PAGE, PIECE_KEYS

__all__ = ["PACKED", "Pieces", "OFF", "packed_pieces", "gathered_pieces", "page_pieces"]


@dataclasses.dataclass(frozen=True)
class Pieces:
    """A decode's pieces (``kernels.packed``): ``fwd_packed`` reads K / V rows in place as pieces
    of ``W`` rows, ``fwd_packed_paged`` the same over the keys gathered as pages (``pages``),
    ``fwd_packed_pages`` a paged cache's own pages in place (``in_place``); ``S = 0`` (``OFF``)
    leaves the call to ``fwd_ragged``."""

    first: np.ndarray  # [NPc + tails] int32: each piece's first sequence (its slot 0); the tail pieces last
    scalars: tuple[int, int, int, int]  # W, NPc, P0, S
    pages: tuple | None = None  # int32 tables after first: (pb [NU], pv [NU], starts [B]) of the gathered
    # pages (fwd_packed_paged), or (pid [NPc * PAGE_GROUP], the last sub-pages' pb [B] and pv [B],
    # starts [B]) with in_place
    page: int = 0  # PG: rows per page (with in_place, per sub-page: kernels.packed.PAGE_ROWS)
    in_place: bool = False

    @property
    def on(self) -> bool:
        return self.scalars[3] > 0

    @property
    def function(self) -> str:
        if not self.on:
            return "fwd_ragged"
        return "fwd_packed" if self.pages is None else "fwd_packed_pages" if self.in_place else "fwd_packed_paged"

    def table(self) -> np.ndarray:
        return np.concatenate([self.first, *(self.pages or ())])

    def call_scalars(self) -> tuple[int, ...]:
        if not self.on:
            return ()
        return self.scalars + (() if self.pages is None else (len(self.pages[0]), self.page))


def page_pieces(frame: Frame, group: int) -> Pieces:
    """The pieces of ``fwd_packed_pages``: a paged cache's rows in place as sub-pages of
    ``PAGE_ROWS`` rows, ``PAGE_GROUP`` of one sequence per whole piece (the sub-pages before its
    last, in order; a short group repeats its first sub-page, masked), plus one tail piece per
    sequence (its last sub-page, copied with the rows it does not own zeroed); ``OFF`` where the
    page is not a multiple of ``PAGE_ROWS`` or a sequence has more query rows than a piece
    holds."""
    page, sub = frame.page, PAGE_ROWS
    kl = frame.desc[:, 1].astype(np.int64)
    if not frame.paged or page % sub or frame.q_idx.shape[1] * group > PIECE_ROWS or not (kl > 0).any():
        return OFF
    n_sub = -(-kl // sub)
    last = np.maximum(n_sub - 1, 0)  # sub-pages before the last: read in place
    n_pc = -(-last // PAGE_GROUP)
    b, g = runs(n_pc)  # whole piece g of sequence b: sub-pages g * PAGE_GROUP + [0, PAGE_GROUP)

    def base(bb, jj):  # its first row in the cache read as rows
        return frame.k_base[bb, (jj * sub) // page] + (jj * sub) % page

    j = g[:, None] * PAGE_GROUP + np.arange(PAGE_GROUP)
    j = np.where(j < last[b][:, None], j, g[:, None] * PAGE_GROUP)  # a short group repeats its first
    pid = (base(b[:, None], j) // sub).astype(np.int32).ravel()
    rows = np.arange(len(kl))
    first = np.concatenate([b, rows]).astype(np.int32)
    last_pb = np.where(kl > 0, base(rows, last), 0).astype(np.int32)
    last_pv = (kl - last * sub).clip(0).astype(np.int32)
    width = PAGE_GROUP * sub
    starts = ((np.cumsum(n_pc) - n_pc) * width).astype(np.int32)
    return Pieces(first, (width, len(b), 0, 1), (pid, last_pb, last_pv, starts), sub, in_place=True)


OFF = Pieces(np.zeros(1, np.int32), (64, 0, 0, 0))


def packed_pieces(frame: Frame, k_rows: int, group: int) -> Pieces:
    """The pieces of ``frame`` over K / V of ``k_rows`` rows, or ``OFF`` where the packed path
    does not apply: more query rows than a piece holds, more sequences in a piece than its slots
    at every width, or keys that are not the rows of K / V one run per sequence in order from
    row 0 (group mode's packed keys). The pieces read every row of K / V, and a row no sequence
    owns may hold anything: NaN in the caller's padding would reach every row of its piece
    through ``0 * NaN``."""
    kl = frame.desc[:, 1].astype(np.int64)
    live = np.flatnonzero(kl > 0)
    if frame.k_base.shape[1] != 1 or len(live) == 0:
        return OFF
    start = frame.k_base[live, 0].astype(np.int64)
    end = start + kl[live]
    if start[0] != 0 or end[-1] != k_rows or (start[1:] != end[:-1]).any():
        return OFF  # every row read must be a key of some sequence (the caller's gaps may hold NaN)
    return _pieces(start, end, live, k_rows, frame.q_idx.shape[1] * group)


def gathered_pieces(frame: Frame, group: int) -> Pieces:
    """The pieces of ``fwd_packed_paged``: each sequence's keys gathered as pages of ``PG`` rows
    one after the other (``pb`` each page's first row, ``pv`` its rows in use: the unused end of a
    sequence's last page is zeroed), so that every row the pieces read is a key or a zero; then as
    ``packed_pieces`` over them. A paged cache's pages are its own (``PG`` its page size); runs
    with gaps between them (``seqlen_k``, ``cu_seqlen`` padding) are cut into pages of
    ``GATHER_PAGE`` rows."""
    kl = frame.desc[:, 1].astype(np.int64)
    live = np.flatnonzero(kl > 0)
    if len(live) == 0 or (not frame.paged and frame.k_base.shape[1] != 1):
        return OFF
    page = frame.page if frame.paged else GATHER_PAGE
    n_pages = -(-kl // page)
    starts = (np.cumsum(n_pages) - n_pages) * page
    # spare zero pages after the last (rows no piece's sequence owns, masked out) round the
    # gathered buffer and the pieces' state as the frame's keys are (frame_keys): a decode loop's
    # calls then allocate the same sizes for many calls in a row
    total = int(n_pages.sum())
    spare = frame_keys(total) - total
    pc = _pieces(starts[live], starts[live] + kl[live], live, (total + spare) * page, frame.q_idx.shape[1] * group)
    if not pc.on:
        return OFF
    b, j = runs(n_pages)
    pb = frame.k_base[b, j] if frame.paged else frame.k_base[b, 0] + j * page
    pv = np.minimum(page, kl[b] - j * page)
    pb, pv = (np.concatenate([x.astype(np.int32), np.zeros(spare, np.int32)]) for x in (pb, pv))
    return dataclasses.replace(pc, pages=(pb, pv, starts.astype(np.int32)), page=page)


def _pieces(start: np.ndarray, end: np.ndarray, live: np.ndarray, k_rows: int, rows: int) -> Pieces:
    """Pieces over ``k_rows`` rows holding the runs ``[start, end)`` of the sequences ``live``
    (in order, not overlapping), ``rows`` query rows per sequence; the widest width that keeps
    every piece within its slots."""
    if rows > PIECE_ROWS:
        return OFF
    slots = PIECE_ROWS // rows
    for w in PIECE_KEYS:
        if k_rows < w:
            continue
        p0, p_end = int(start[0]) // w, -(-int(end[-1]) // w)
        full = max(min(p_end, k_rows // w), p0)
        lo = np.append((p0 + np.arange(full - p0)) * w, full * w)  # the tail counts rows from full * w
        hi = np.append(lo[:-1] + w, k_rows)
        f, l = np.searchsorted(end, lo, side="right"), np.searchsorted(start, hi, side="left") - 1
        has = f <= l
        fb = np.where(has, live[np.minimum(f, len(live) - 1)], 0)
        lb = np.where(has, live[np.maximum(l, 0)], 0)
        if not ((lb - fb + 1)[has] > slots).any():
            return Pieces(fb.astype(np.int32), (w, full - p0, p0, slots))
    return OFF


class _Packed:
    """The decode path (this module's docstring)."""

    name = "packed"
    modes = ("batch", "group", "paged")

    def plan(self, prob: Problem, caps: Capabilities):
        miss = caps.missing("fwd_packed", "fwd_packed_paged")
        if miss:
            return Refused((miss + " (bshd GPU modules without padded head dims have them)",))
        if prob.mode == "batch" and not prob.padded:
            return Refused(("a batch without cu_seqlen padding: fwd serves it in one call",))
        rows = int(prob.q_len.max(initial=0)) * prob.group
        if rows > PIECE_ROWS:
            return Refused((f"not decode-shaped: {rows} query rows per sequence and KV head, a piece holds "
                            f"{PIECE_ROWS}",))
        frame = problem_frame(prob)
        pieces = OFF
        if frame.paged:  # the cache's own pages where they can be pieces
            pieces = OFF if not caps.has("fwd_packed_pages") else page_pieces(frame, prob.group)
        else:
            k = prob.p.k.array.shape
            pieces = packed_pieces(frame, int(k[0]) * int(k[1]), prob.group)
        if not pieces.on:  # small pages, or runs with gaps: the keys gathered first
            pieces = gathered_pieces(frame, prob.group)
        if not pieces.on:
            return Refused(("more sequences share a piece than it has slots at every width "
                            f"{PIECE_KEYS}",))
        idx, sizes = frame.table(pieces.table())
        scalars = (float(prob.p.scale), *sizes, *frame.coords(), *pieces.call_scalars())
        return TableCall(pieces.function, idx, scalars, prob.p.q.dtype, (prob.out_shape, prob.lse_shape),
                         note=f"split-KV pieces of {pieces.scalars[0]} keys")


PACKED = _Packed()
