"""Ragged problems on a module's ``fwd_ragged``: batches with cu_seqlen padding, group mode, paged
KV caches, each as one padded frame on the device.

A frame is a batch ``[B, Sq_f, H, D]`` (the module's layout) with one row of sequences per batch
entry: ``Sq_f`` / ``Sk_f`` the longest query and key counts, each sequence left-aligned, its rows
and keys past its own lengths zero. Gathers build and read it (``kernels.frames``): the index
arrays below say which source row lands in each frame row (for a paged cache the block table
does), so a new batch composition changes data, never the module. ``fwd_ragged`` then runs every
sequence with its own lengths and mask (``kernels.bounds``: the interior shared by all, edges
masked per sequence), each group of rows over the entries that have rows in it (the frame
ordered longest first, ``Frame.by_length`` / ``Frame.prefix``), and the last gathers put its rows
where the caller expects them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .kernels.bounds import PREFIX_STEPS
from .plan import runs

__all__ = ["Frame", "Pieces", "OFF", "packed_pieces", "gathered_pieces", "page_pieces", "frame_keys", "descriptors", "ragged_coords", "frame_rows", "batch_frame", "group_frame", "paged_bases",
           "FrameCall", "frame_call",
           "has_ragged"]

@dataclasses.dataclass(frozen=True)
class Frame:
    """Index arrays and ``fwd_ragged``'s arguments for one ragged call."""

    q_idx: np.ndarray  # [B, Sq_f] int32: source row of each frame query row, -1 none
    k_base: np.ndarray  # [B, NP] int32: key j < klen of sequence b is row k_base[b, j // page] + j % page
    page: int
    sk_f: int  # the frame's keys: the longest klen, rounded up (frame_keys)
    desc: np.ndarray  # [B, 4] int32: (qlen, klen, y, x) per sequence
    out_idx: np.ndarray  # [N, R] int32: frame row (b * Sq_f + s) of each output row, -1 none
    lse_idx: np.ndarray  # [N, R2] int32: frame row of each LSE column
    paged: bool = False  # k_base holds a paged cache's pages (block table times page size)

    @property
    def empty(self) -> bool:
        """Nothing to compute: no query row or no key in any sequence."""
        return not (self.desc[:, 0] > 0).any() or self.sk_f == 0

    def coords(self) -> tuple[int, ...]:
        return ragged_coords(self.desc, self.q_idx.shape[1], self.sk_f)

    def by_length(self) -> "Frame":
        """The same problem with its batch entries ordered by query count, longest first (ties
        in order), so that the entries with a query row at or past any row form a prefix of the
        batch (``prefix``). The index arrays move with their entries; the output and LSE rows
        name the entries' new frame rows."""
        order = np.argsort(-self.desc[:, 0].astype(np.int64), kind="stable")
        if (order == np.arange(len(order))).all():
            return self
        sq_f = self.q_idx.shape[1]
        new_at = np.empty_like(order)
        new_at[order] = np.arange(len(order))

        def moved(idx):  # frame row b * sq_f + i -> new_at[b] * sq_f + i
            idx = idx.astype(np.int64)
            return np.where(idx < 0, -1, new_at[np.maximum(idx, 0) // sq_f] * sq_f + idx % sq_f).astype(np.int32)

        return dataclasses.replace(self, q_idx=self.q_idx[order], k_base=self.k_base[order], desc=self.desc[order],
                                   out_idx=moved(self.out_idx), lse_idx=moved(self.lse_idx))

    def prefix(self) -> tuple[int, ...]:
        """``fwd_ragged``'s ``(U, nb0 .. nb15)``: ``nb_i`` counts the leading batch entries that
        hold every entry with a query row at or past row ``i * U`` (all of them in a frame ordered
        by ``by_length``); a group of rows starting at row ``a`` computes only the first
        ``nb_(a // U)`` entries (``kernels.ragged``). ``U = ceil(Sq_f / 16)``."""
        ql = self.desc[:, 0].astype(np.int64)
        unit = max(1, -(-self.q_idx.shape[1] // PREFIX_STEPS))
        at = np.arange(PREFIX_STEPS) * unit
        last = np.array([np.flatnonzero(ql > a).max(initial=-1) for a in at])  # the last entry with such a row
        return (unit, *(int(n) for n in last + 1))

    def table(self, pieces: "Pieces") -> tuple[np.ndarray, tuple[int, ...]]:
        """``fwd_ragged``'s index table (ending with ``pieces``' table) and its size scalars
        (``kernels.ragged``)."""
        idx = np.concatenate([self.q_idx.ravel(), self.k_base.ravel(), self.desc.T.ravel(), self.out_idx.ravel(),
                              self.lse_idx.ravel(), pieces.table()]).astype(np.int32)
        b, sq_f = self.q_idx.shape
        return idx, (b, sq_f, self.sk_f, self.k_base.shape[1], self.page, *self.out_idx.shape, *self.lse_idx.shape)


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


def page_pieces(frame: "Frame", group: int) -> Pieces:
    """The pieces of ``fwd_packed_pages``: a paged cache's rows in place as sub-pages of
    ``PAGE_ROWS`` rows, ``PAGE_GROUP`` of one sequence per whole piece (the sub-pages before its
    last, in order; a short group repeats its first sub-page, masked), plus one tail piece per
    sequence (its last sub-page, copied with the rows it does not own zeroed); ``OFF`` where the
    page is not a multiple of ``PAGE_ROWS`` or a sequence has more query rows than a piece
    holds."""
    from .kernels.packed_common import PAGE_GROUP, PAGE_ROWS  # here: not every process needs the kernels

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
PIECE_KEYS = (256, 128, 64)  # widths tried, widest first (multiples of the modules' key tile)
GATHER_PAGE = 64  # rows per page when runs with gaps are gathered for the pieces
PIECE_ROWS = 16  # query rows per piece (the short tier's tile): Sq * G up to it, S = 16 // (Sq * G)


def packed_pieces(frame: "Frame", k_rows: int, group: int) -> Pieces:
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


def gathered_pieces(frame: "Frame", group: int) -> Pieces:
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


def frame_keys(longest: int) -> int:
    """The frame's key count for a longest sequence of ``longest`` keys: rounded up to one of 32
    steps per power of two (at most 1/16 more keys, each zero and masked). A decode loop whose key
    counts grow by one per call then makes the same frame, and so the same allocations, for many
    calls in a row: a CUDA device serves a repeated size from its cache (``allocation.allocator_policy``)."""
    if longest <= 64:
        return longest
    step = 1 << (longest.bit_length() - 5)
    return -(-longest // step) * step


def ragged_coords(desc: np.ndarray, sq_f: int, sk_f: int) -> tuple[int, int, int, int, int, int]:
    """``fwd_ragged``'s ``(y, x, yu, xu, khi, khiu)``: the interior's coordinates (the tightest of
    the sequences with a query row) and the union's (the loosest). A sequence whose every row sees
    keys from 0 counts as ``y = Sq_f + 1``; one whose rows all reach its key count as
    ``x = Sk_f + 1`` with its key count as a limit (``khi``); so is one whose last row would reach
    past its keys."""
    ql, kl, y, x = (desc[:, i].astype(np.int64) for i in range(4))
    live = ql > 0
    ql, kl, y, x = ql[live], kl[live], y[live], x[live]
    y_eff = np.where(y >= ql, sq_f + 1, y)
    reach_all = x >= kl
    x_eff = np.where(reach_all, sk_f + 1, x)
    binds = reach_all | (ql - 1 + x > kl)
    khi = int(kl[binds].min()) if binds.any() else sk_f
    return int(y_eff.min()), int(x_eff.min()), int(y_eff.max()), int(x_eff.max()), khi, int(kl.max())


def frame_rows(starts: np.ndarray, lens: np.ndarray, width: int) -> np.ndarray:
    """``[B, width]`` int32: ``starts[b] + j`` for ``j < lens[b]``, else -1."""
    j = np.arange(width, dtype=np.int64)
    rows = np.asarray(starts, np.int64)[:, None] + j
    return np.where(j < np.asarray(lens, np.int64)[:, None], rows, -1).astype(np.int32)


def paged_bases(block_table: np.ndarray, page_size: int, lens: np.ndarray) -> np.ndarray:
    """``[B, ceil(max(lens) / page_size)]`` int32: each sequence's pages as the flat cache row of
    their first key (``block_table * page_size``); columns past a sequence's last page 0 (never
    read: their keys are past its length)."""
    lens = np.asarray(lens, np.int64)
    n = max(1, -(-int(lens.max(initial=0)) // page_size))
    cols = np.arange(n)
    used = cols[None, :] * page_size < lens[:, None]
    return np.where(used, block_table[:, :n].astype(np.int64) * page_size, 0).astype(np.int32)


def _contiguous(starts) -> np.ndarray:
    """Row bases of contiguous sequences: one page each, starting at its start."""
    return np.asarray(starts, np.int64)[:, None].astype(np.int32)


def descriptors(mask, q_len: np.ndarray, k_len: np.ndarray) -> np.ndarray:
    """``[B, 4]`` int32: each sequence's (qlen, klen, y, x), CK's coordinates for its own lengths
    (``Mask.clipped_coords``, evaluated over all sequences at once: a decode batch of 1024
    sequences took 1.1 ms of host time per call one sequence at a time); the ``rows`` entry points
    read the same rows."""
    ql, kl = np.asarray(q_len, np.int64).reshape(-1), np.asarray(k_len, np.int64).reshape(-1)
    y, x = mask.coords(ql, kl)  # elementwise over the arrays
    y = np.minimum(np.maximum(y, -kl), ql + 1)
    x = np.minimum(np.maximum(x, -ql), kl + 1)
    return np.stack([ql, kl, y, x], axis=1).astype(np.int32)


def _out_rows(q_len: np.ndarray, sq_f: int, dest: np.ndarray, total: int) -> np.ndarray:
    """``[1, total]`` int32: the frame row of each destination row (``dest[b] + i`` for query
    ``i`` of sequence ``b``), -1 elsewhere."""
    idx = np.full(total, -1, np.int64)
    b, i = runs(q_len)
    idx[np.asarray(dest, np.int64)[b] + i] = b * sq_f + i
    return idx.astype(np.int32)[None]


def batch_frame(mask, q_len: np.ndarray, k_len: np.ndarray, sq: int, sk: int) -> Frame:
    """A batch ``[B, Sq, ...]`` with cu_seqlen padding: batch ``b``'s rows ``q_len[b]`` and keys
    ``k_len[b]``; the output keeps the batch's shape (padded rows 0, their LSE -inf)."""
    q_len, k_len = np.asarray(q_len, np.int64), np.asarray(k_len, np.int64)
    sq_f, longest = int(q_len.max(initial=0)), int(k_len.max(initial=0))
    batch = np.arange(len(q_len))
    out = frame_rows(batch * sq_f, q_len, sq)
    return Frame(frame_rows(batch * sq, q_len, sq_f), _contiguous(batch * sk), max(longest, 1), frame_keys(longest),
                 descriptors(mask, q_len, k_len), out, out)


def group_frame(mask, starts, total_rows: int, pages: tuple[np.ndarray, int] | None = None) -> Frame:
    """Group mode's sequences (``spec.check_varlen``'s starts) over packed ``[1, T, H, D]``
    tensors; ``pages`` = (row bases, page size) of a paged cache (``paged_bases``) in place of
    the keys' starts."""
    q_start, q_len, k_start, k_len, lse_start, total_q = starts
    sq_f, longest = int(q_len.max(initial=0)), int(k_len.max(initial=0))
    base, page = (_contiguous(k_start), max(longest, 1)) if pages is None else pages
    return Frame(frame_rows(q_start, q_len, sq_f), base, page, frame_keys(longest), descriptors(mask, q_len, k_len),
                 _out_rows(q_len, sq_f, q_start, total_rows), _out_rows(q_len, sq_f, lse_start, total_q), pages is not None)


@dataclasses.dataclass(frozen=True)
class FrameCall:
    """One ragged call with everything but the tensors fixed: the entry point, its index table
    and its scalars (``frame_call``)."""

    function: str
    idx: np.ndarray  # int32: the entry point's index table
    scalars: tuple
    dtype: str

    def run(self, module, q, k, v, *, keep: bool):
        """The call on ``q`` / ``k`` / ``v`` (rank 4 in the module's layout; ABI arrays or
        DeviceTensors), its table staged through the module's upload ring (no host wait; the
        ring's slots also bound the calls in flight). Returns (out ``[N, R, Hq, Dv]``, lse ``[N2,
        Hq, R2]``), numpy or DeviceTensors with ``keep``."""
        out, lse = module.call(self.function, [(q, self.dtype), (k, self.dtype), (v, self.dtype)], staged=[self.idx],
                               scalars=self.scalars, results=[self.dtype, "f32"], keep_on_device=keep)
        return out, lse


def frame_call(module, frame: Frame, q_shape, k_shape, *, dtype: str, scale: float) -> FrameCall:
    """``frame``'s call on ``module`` for tensors of these shapes (rank 4, the module's layout):
    ``fwd_packed`` where its keys are packed (``packed_pieces``), ``fwd_packed_pages`` where a
    paged cache's pages can be read in place (``page_pieces``), ``fwd_packed_paged`` where a
    decode's keys must be gathered first (``gathered_pieces``), else ``fwd_ragged`` (one call,
    ``kernels.ragged``)."""
    pieces = OFF
    if not module.lacks(["fwd_packed", "fwd_packed_paged"]):  # a bshd module: keys as rows n * R + r of [N, R, Hk, D]
        group = int(q_shape[2]) // max(int(k_shape[2]), 1)
        if frame.q_idx.shape[1] * group <= PIECE_ROWS:  # decode-shaped: prefill frames skip the key arithmetic
            if frame.paged:  # the cache's own pages where they can be pieces
                pieces = OFF if module.lacks(["fwd_packed_pages"]) else page_pieces(frame, group)
            else:
                pieces = packed_pieces(frame, int(k_shape[0]) * int(k_shape[1]), group)
            if not pieces.on:  # small pages, or runs with gaps: the keys gathered first
                pieces = gathered_pieces(frame, group)
    if not pieces.on:  # fwd_ragged: a group of rows computes only the entries with rows in it
        frame = frame.by_length()
    idx, sizes = frame.table(pieces)
    extra = pieces.call_scalars() if pieces.on else frame.prefix()
    return FrameCall(pieces.function, idx, (float(scale), *sizes, *frame.coords(), *extra), dtype)


def has_ragged(module, layout: str) -> bool:
    """Whether ``module`` runs ragged problems from ``layout`` tensors in one frame
    (``fwd_ragged``, whose tensors are in the module's layout: group mode needs ``bshd``)."""
    return module is not None and getattr(module, "layout", None) == layout and not module.lacks(["fwd_ragged"])
