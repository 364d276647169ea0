"""Tiling plan: which work units run, in which launches, and where each output row comes from.

The query rows of every sequence are cut into tiles of ``R = tiles.m0`` rows. For each tile, CK's
``GetTileRangeAlongX`` (``Mask.tile_range``) gives the key range the mask leaves visible; that range
is cut into chunks of ``C = tiles.kv_chunk`` keys, one work unit each. Keys outside the range are
never visited, so causal costs about half of unmasked and a window of ``w`` keys about ``Sq * w``.

Units are launched in waves: a ``step`` call holds at most one unit per tile (wave ``w`` holds the
``w``-th unit of every tile), so each call's merge into the tiles' online-softmax state is a plain
scatter. A wave larger than ``max_units`` is split over several calls to bound the memory of one
call's scores (``max_units * Hq * R * C`` floats).

A ``step`` call returns the whole state it was given (its inputs are immutable), so a call costs a
copy of that state besides its units. The tiles are therefore cut into blocks of at most
``block_tiles`` (``state_tiles``), each block with a state of its own and its waves run one block
after another: the copies grow with the block, not with the problem (without blocks, a problem
twice as large made twice the calls, each copying twice the state).

Only numpy is needed here.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .mask import Mask
from .tiles import TileConfig

__all__ = ["Sequences", "Plan", "Block", "build_plan", "units_budget", "state_tiles", "runs"]

# Upper bound on one step call's score elements (Hq * R * C per unit).
# CPU: 4 Mi floats = 16 MiB (four units of H8 x 256 x 512). The step's dispatches each pass over
# the whole call's scores, so they should stay cache-sized: on the 2-core dev CPU 8 Mi measured
# slower than 4 Mi with 256x512 units (tiles._CPU's sweep; docs/BENCHMARKS.md, "CPU: the 2-core
# x86_64 development machine").
# GPU: the fused online_attention never materializes scores; the bound only caps the per-call
# gathers and the i1 mask (256 Mi elements), and every call costs host overhead comparable to its
# GPU time (H200 profile: docs/tried.md, "Whole-problem GPU steps"), so calls are as large as that
# allows.
SCORE_BUDGET = {"cpu": 1 << 22, "gpu": 1 << 28}


def runs(lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For consecutive runs of ``lens[r]`` elements (rows of sequences, chunks of tiles): each
    element's run and its position within the run (``lens = [2, 3]``: ``[0, 0, 1, 1, 1]``,
    ``[0, 1, 0, 1, 2]``)."""
    lens = np.asarray(lens)
    return np.repeat(np.arange(len(lens)), lens), np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)


# Upper bound on the bytes of one block's state (``Block``) on the CPU: against one state for all
# tiles (each call copying it whole) and 4 or 64 MB blocks, 16 MB held up best across batch sizes
# on the dev CPU (docs/BENCHMARKS.md, "CPU: the 2-core x86_64 development machine").
STATE_BUDGET = {"cpu": 16 << 20}


def units_budget(hq: int, tiles: TileConfig, family: str = "cpu") -> int:
    budget = SCORE_BUDGET["cpu" if family == "cpu" else "gpu"]
    return max(1, budget // (hq * tiles.m0 * tiles.kv_chunk))


def state_tiles(hq: int, dv: int, tiles: TileConfig, family: str = "cpu") -> int:
    """Tiles per state block (0: one block). The GPU keeps one block: its state copies run at the
    device's memory rate and its modules serve the plan only as a fallback."""
    budget = STATE_BUDGET.get("cpu" if family == "cpu" else "gpu", 0)
    per_tile = 4 * hq * tiles.m0 * (dv + 2)  # acc, max and sum of one tile, f32
    return max(units_budget(hq, tiles, family), budget // per_tile) if budget else 0


@dataclasses.dataclass
class Sequences:
    """One entry per sequence: its batch slot, physical starts on the sequence axis, lengths, and
    where its rows go in the ``lse`` output."""

    b: np.ndarray
    q_start: np.ndarray
    q_len: np.ndarray
    k_start: np.ndarray
    k_len: np.ndarray
    lse_start: np.ndarray | None = None

    @classmethod
    def batch(cls, q_lens: np.ndarray, k_lens: np.ndarray) -> "Sequences":
        """Batch mode: sequence ``b`` starts at row 0 of slot ``b``."""
        n = len(q_lens)
        zero = np.zeros(n, np.int64)
        return cls(np.arange(n, dtype=np.int64), zero, np.asarray(q_lens, np.int64), zero, np.asarray(k_lens, np.int64))


@dataclasses.dataclass
class Block:
    """Tiles ``[t0, t0 + n_tiles)`` with a state of their own: ``calls`` are ``[P, 10]`` int32
    descriptor arrays, one per step call in order, their tile column relative to ``t0``;
    ``unmasked[i]``: every unit of call ``i`` has R rows that each see all C keys of its chunk
    (a module's ``step_open`` takes such calls)."""

    t0: int
    n_tiles: int
    calls: list
    unmasked: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Plan:
    n_tiles: int
    blocks: list  # Block, in order of their tiles
    out_map: np.ndarray  # [Bo, So] int32: state slot of each output row, -1 if none
    lse_map: np.ndarray  # [Bl, Sl] int32
    n_units: int

    @property
    def n_calls(self) -> int:
        return sum(len(blk.calls) for blk in self.blocks)


def _slots(seqs: Sequences, tile_base: np.ndarray, rows: int, starts: np.ndarray, shape) -> np.ndarray:
    """Map each row of an output of ``shape`` (slot b, position s) to its state slot."""
    out = np.full(shape, -1, np.int64)
    n = seqs.q_len
    total = int(n.sum())
    if total:
        seq, rel = runs(n)
        out[seqs.b[seq], starts[seq] + rel] = tile_base[seq] * rows + rel
    return out.astype(np.int32)


def build_plan(seqs: Sequences, mask: Mask, tiles: TileConfig, out_shape, lse_shape, max_units: int,
               block_tiles: int = 0, split_unmasked: bool = False) -> Plan:
    """The plan of ``seqs`` under ``mask``: calls of at most ``max_units`` units, in blocks of at
    most ``block_tiles`` tiles (0: one block). ``split_unmasked``: a wave's units that see every
    key of their chunk go to calls of their own (``Block.unmasked``)."""
    R, C, n0 = tiles.m0, tiles.kv_chunk, tiles.n0
    q_len, k_len = seqs.q_len, seqs.k_len
    nt_seq = -(-q_len // R)
    tile_base = np.cumsum(nt_seq) - nt_seq
    n_tiles = int(nt_seq.sum())

    seq = np.repeat(np.arange(len(q_len)), nt_seq)
    qrel0 = (np.arange(n_tiles) - tile_base[seq]) * R
    sq, sk = q_len[seq], k_len[seq]
    y, x = mask.coords(sq, sk)
    y = np.broadcast_to(y, sq.shape)
    x = np.broadcast_to(x, sq.shape)
    lo, hi = mask.tile_range(qrel0, R, sq, sk, n0)
    n_chunks = np.where(hi > lo, -(-(hi - lo) // C), 0)

    n_units = int(n_chunks.sum())
    u_tile, u_wave = runs(n_chunks)
    us = seq[u_tile]
    krel0 = lo[u_tile] + u_wave * C
    desc = np.stack(
        [
            u_tile, seqs.b[us], seqs.q_start[us] + qrel0[u_tile], seqs.k_start[us] + krel0,
            qrel0[u_tile], krel0, sq[u_tile], sk[u_tile], y[u_tile], x[u_tile],
        ],
        axis=1,
    ).astype(np.int32)

    # A unit is unmasked when its R rows are all rows of the sequence and each sees the chunk's C
    # keys: lo(i) = i - y + 1 grows with i (the last row's), hi(i) = i + x too (the first row's).
    q_end, k_end = qrel0[u_tile] + R, krel0 + C
    whole = (q_end <= sq[u_tile]) & (k_end <= sk[u_tile]) & (q_end - y[u_tile] <= krel0) & \
        (qrel0[u_tile] + x[u_tile] >= k_end)
    whole &= bool(split_unmasked)
    span = block_tiles if 0 < block_tiles < n_tiles else max(n_tiles, 1)
    blk = u_tile // span
    order = np.lexsort((u_tile, whole, u_wave, blk))  # by block, then wave (masked units first), then tile
    desc, u_wave, blk, whole = desc[order], u_wave[order], blk[order], whole[order]
    desc[:, 0] -= (blk * span).astype(np.int32)
    firsts = np.searchsorted(blk, np.arange(0, n_tiles, span) // span)
    ends = np.append(firsts[1:], len(desc))
    blocks = [Block(t0, min(span, n_tiles - t0), *_calls(desc[a:b], u_wave[a:b] * 2 + whole[a:b], max_units))
              for t0, a, b in zip(range(0, n_tiles, span), firsts, ends)]

    lse_start = seqs.q_start if seqs.lse_start is None else seqs.lse_start
    out_map = _slots(seqs, tile_base, R, seqs.q_start, out_shape)
    lse_map = _slots(seqs, tile_base, R, lse_start, lse_shape)
    return Plan(n_tiles, blocks, out_map, lse_map, n_units)


def _calls(desc: np.ndarray, group: np.ndarray, max_units: int) -> tuple[list, list]:
    """One block's units (ordered by ``group``: wave * 2 + unmasked) as step calls of at most
    ``max_units`` units, wave by wave. A wave's unmasked units get calls of their own only in
    whole calls of ``max_units``; the rest join its masked units (a call more costs a copy of the
    state, ``state_tiles``). Returns the calls and whether each is unmasked."""
    calls, unmasked = [], []
    cuts = np.flatnonzero(np.diff(group // 2)) + 1
    for units, g in zip(np.split(desc, cuts), np.split(group, cuts)) if len(desc) else []:
        n_open = int((g % 2).sum()) // max_units * max_units  # unmasked units sort last
        parts = ((units[len(units) - n_open:], True), (units[: len(units) - n_open], False))
        for part, is_open in parts:
            for i in range(0, len(part), max_units):
                calls.append(np.ascontiguousarray(part[i : i + max_units]))
                unmasked.append(is_open)
    return calls, unmasked


def unit_tiles(starts: tuple, coords: tuple, *, rows: int, group: int) -> np.ndarray:
    """The tile table of ``units_varlen`` (``mlir_templates.unit_varlen.TILE_COLUMNS``): one row
    per ``rows``-row tile of every sequence and query head of a KV head, ordered by head, then
    row (a tile's rows past its sequence's end are the next sequence's, which writes them later).
    ``starts`` = (q_start, q_len, k_start, k_len) per sequence, ``coords`` = CK's (y, x) for each
    sequence's lengths (``frames.descriptors``). int64 ``[N, 8]``."""
    q_start, q_len, k_start, k_len = (np.asarray(a, np.int64).reshape(-1) for a in starts)
    y, x = (np.asarray(a, np.int64).reshape(-1) for a in coords)
    seq, i = runs(-(-q_len // rows))
    s0 = i * rows
    first = q_start[seq] + s0
    per_tile = [np.tile(a, group) for a in (first, s0, q_len[seq], k_start[seq], k_len[seq], y[seq], x[seq])]
    g = np.repeat(np.arange(group, dtype=np.int64), len(first))
    table = np.stack([*per_tile, g], axis=1)
    return np.ascontiguousarray(table[np.lexsort((table[:, 0], g))])


@dataclasses.dataclass(frozen=True)
class WaveTables:
    """The tables of ``waves_varlen`` (``mlir/unit_waves.mlir.in`` states their layout): ``chunks``
    [NC, 2], ``slots`` [NS, 2], ``steps`` [NT, 4, NS], ``rowslot`` [G, Tq] (int32, device inputs)
    and ``levels`` [L, 3] (int64, read by the module's host code)."""

    chunks: np.ndarray
    slots: np.ndarray
    steps: np.ndarray
    rowslot: np.ndarray
    levels: np.ndarray


_I32 = 1 << 30  # window bounds clipped here: every comparison with a row or key of a chunk keeps its result


def wave_tables(starts: tuple, coords: tuple, total_q: int, *, rows: int, chunk: int, group: int) -> WaveTables:
    """``waves_varlen``'s tables for sequences ``starts`` = (q_start, q_len, k_start, k_len) with
    CK's ``coords`` (y, x) for each one's lengths, packed into ``total_q`` rows:
    each sequence's keys in ``chunk``-key chunks, its rows in ``rows``-row slots (one per query
    head of a KV head), each slot stepping over the chunks that hold the keys its rows see, slots
    ordered by step count, most first."""
    q_start, q_len, k_start, k_len, y, x = (np.asarray(a, np.int64).reshape(-1) for a in (*starts, *coords))
    tq = max(int(total_q), 1)
    nch = -(-np.maximum(k_len, 0) // chunk)
    cbase = np.cumsum(nch) - nch
    cseq, ci = runs(nch)
    chunks = np.stack([k_start[cseq] + ci * chunk, np.minimum(chunk, k_len[cseq] - ci * chunk)], 1)
    seq, t = runs(-(-np.maximum(q_len, 0) // rows))
    s0 = t * rows
    nrows = np.minimum(rows, q_len[seq] - s0)
    lo = np.maximum(s0 - y[seq] + 1, 0)
    hi = np.minimum(s0 + nrows - 1 + x[seq], k_len[seq])
    first = lo // chunk
    nsteps = np.where(hi > lo, -(-hi // chunk) - first, 0)
    g = np.repeat(np.arange(group, dtype=np.int64), len(seq))
    seq, s0, nrows, first, nsteps = (np.tile(a, group) for a in (seq, s0, nrows, first, nsteps))
    order = np.argsort(-nsteps, kind="stable")
    seq, s0, nrows, first, nsteps, g = (a[order] for a in (seq, s0, nrows, first, nsteps, g))
    slots = np.stack([q_start[seq] + s0, g], 1)
    nt = int(nsteps.max()) if len(nsteps) else 0
    neg_steps, first_of = np.unique(-nsteps, return_index=True)  # step counts, most first, and their first slot
    n_slots = np.diff(np.append(first_of, len(nsteps)))
    levels = np.stack([first_of, n_slots, -neg_steps], 1)[neg_steps < 0].astype(np.int64)
    n = np.arange(nt)[:, None]
    kpos = (first[None, :] + n) * chunk
    steps = np.stack([cbase[seq][None, :] + first[None, :] + n,
                      np.clip(s0 - y[seq] + 1 - kpos, -_I32, _I32), np.clip(s0 + x[seq] - kpos, -_I32, _I32),
                      np.clip(k_len[seq] - kpos, -_I32, _I32)], 1)
    steps = np.where((n < nsteps[None, :])[:, None, :], steps, 0)  # steps a slot does not run: unread
    rowslot = np.full((group, tq), -1, np.int64)
    pos, rel = runs(nrows)
    rowslot[g[pos], q_start[seq[pos]] + s0[pos] + rel] = pos * rows + rel
    if not len(chunks):  # no keys anywhere: one chunk of zeros, which no step reads
        chunks = np.zeros((1, 2), np.int64)
    if not len(slots):
        slots = np.zeros((1, 2), np.int64)
    if not nt:  # no slot sees a key: one step of zeros, which no level runs
        steps = np.zeros((1, 4, len(slots)), np.int64)
    i32 = (lambda a: np.ascontiguousarray(a, np.int32))
    return WaveTables(i32(chunks), i32(slots), i32(steps), i32(rowslot),
                      np.ascontiguousarray(levels.reshape(-1, 3)))
