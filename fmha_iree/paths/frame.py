"""The frame the GPU's ragged paths share: a problem's sequences (group mode's, a batch's entries,
a paged cache's) as index arrays over a padded batch ``[B, Sq_f, H, D]`` (the module's layout),
one sequence per batch entry, left-aligned, with CK's coordinates for each sequence's own lengths.
``paths.ragged`` runs it as one ``fwd_ragged`` call; ``paths.packed`` reads a decode-shaped one's
keys as split-KV pieces. A new batch composition changes these arrays, never the module.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..problem.abi import PREFIX_STEPS
from ..problem.plan import runs
from ..runtime.module import Const, Staged
from .base import Call, shaped, Problem

__all__ = ["Frame", "TableCall", "frame_keys", "descriptors", "ragged_coords", "frame_rows", "batch_frame",
           "group_frame", "paged_bases", "problem_frame"]


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

    def table(self, pieces: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]]:
        """The frame's index table (ending with a packed call's ``pieces`` table, or one unused
        word for ``fwd_ragged``) and its size scalars (``kernels.ragged``)."""
        idx = np.concatenate([self.q_idx.ravel(), self.k_base.ravel(), self.desc.T.ravel(), self.out_idx.ravel(),
                              self.lse_idx.ravel(), pieces]).astype(np.int32)
        b, sq_f = self.q_idx.shape
        return idx, (b, sq_f, self.sk_f, self.k_base.shape[1], self.page, *self.out_idx.shape, *self.lse_idx.shape)


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




def problem_frame(prob: Problem) -> Frame:
    """The frame of a batch with cu_seqlen padding, a group-mode problem or one over a paged cache."""
    p = prob.p
    if prob.mode == "batch":
        return batch_frame(p.mask, p.q_lens, p.k_lens, p.sq, p.sk)
    pages = None
    if prob.mode == "paged":
        pages = (paged_bases(prob.cache.block_table, prob.cache.page_size, prob.cache.lens), prob.cache.page_size)
    return group_frame(p.mask, prob.starts, p.sq, pages)


@dataclasses.dataclass(frozen=True)
class TableCall(Call):
    """A GPU call driven by one index table (``fwd_tiles``, ``fwd_ragged``, ``fwd_packed*``): the
    function, its table (staged through the module's upload ring: no host wait), its scalars and
    the problem's result shapes."""

    entry: str
    idx: np.ndarray
    scalars: tuple
    dtype: str
    shapes: tuple  # (out, lse) of the problem
    note: str = ""
    slopes: np.ndarray | None = None  # ALiBi slopes, flat float32 (an ALiBi module's fwd_tiles)
    bias: object = None  # a bias module's planes (problem.bias.KernelBias's, an ABI array or DeviceTensor)

    @property
    def replayable(self) -> bool:  # the bias is this call's tensor: a replay would keep it
        return self.bias is None

    def run(self, module, q, k, v, *, keep: bool):
        d = self.dtype
        extra = [] if self.slopes is None else [Const(self.slopes, "f32")]
        extra += [] if self.bias is None else [(self.bias, d)]
        out, lse = module.call(self.entry, [(q, d), (k, d), (v, d), Staged(self.idx), *extra], scalars=self.scalars,
                               results=[d, "f32"], keep_on_device=keep)
        return shaped(out, self.shapes[0]), shaped(lse, self.shapes[1])
