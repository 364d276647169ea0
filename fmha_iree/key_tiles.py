"""The host side of ``fwd_tiles`` (``kernels.tiles``): a problem's sequences (group mode's, or a
batch's entries) cut into tiles of query rows, each with its own key counts, as one index table
per batch composition.

A module that has the path records its sizes in its ``dense`` record (``tiles``: state rows per
tile, the group, the edge's key bound and the interior's key step; ``source.dense_abi``). For a
problem it takes (:func:`refusal` says why not otherwise), :func:`tiles_call` (group mode) and
:func:`batch_call` return the call with everything but the tensors fixed (a ``frames.FrameCall``,
replayed as the frames' calls are).
"""

from __future__ import annotations

import numpy as np

from .frames import PIECE_ROWS, FrameCall, descriptors
from .kernels.tiles import EDGE_PARTS, TILE_COLUMNS

__all__ = ["MAX_TILES", "SQUARE_CAUSAL_MIN", "refusal", "tile_table", "tiles_call", "paged_call", "batch_pays",
           "batch_starts", "batch_call", "module_tiles"]

# tiles run along the grid's y dim (heads along x, so the longest tiles of every head start first),
# at most 65535 workgroups on CUDA and HIP; the edge launches EDGE_PARTS workgroups a tile
MAX_TILES = 65535 // EDGE_PARTS


def refusal(info: dict | None, starts, tq: int, tk: int) -> str | None:
    """Why ``fwd_tiles`` cannot take this group-mode problem, or None where it can. ``info``: the
    module's ``tiles`` record; ``starts``: ``spec.check_varlen``'s; ``tq`` / ``tk``: rows of the
    packed Q and K."""
    if not info:
        return ("the module has no fwd_tiles (built before 2026-12-05, a CPU target, padded head dims, or a gfx "
                "target and head dim whose tiles spilled or failed to compile: source._rocm_tiles)")
    if tuple(info.get("columns", ())) != TILE_COLUMNS:
        return "the module's fwd_tiles reads another table (built before its windows, 2026-12-05): rebuild it"
    q_len = np.asarray(starts[1], np.int64)
    positions = int(info["rows"]) // int(info["group"])
    if tq < positions:
        return f"fewer query rows ({tq}) than a tile's {positions} (the tiles read whole tiles of Q in place)"
    if tk < 1 or not (q_len > 0).any():
        return "no query rows or no keys"
    if int(q_len.max()) * int(info["group"]) <= PIECE_ROWS:
        return "decode-shaped (a few query rows per sequence): split-KV pieces (fwd_packed) serve it"
    if int((-(-q_len // positions)).sum()) > MAX_TILES:
        return f"more than {MAX_TILES} tiles (the grid's second dim on CUDA and HIP, two workgroups a tile's edge)"
    return None


def tile_table(info: dict, mask, starts, tq: int, entry=None) -> tuple[np.ndarray, int, int]:
    """(the index table: tiles ``[N, TILE_COLUMNS]``, the out rows' map ``[B * tq]``, the LSE
    rows' map ``[total]``; N; the widest edge's keys, at least one step) for a problem
    :func:`refusal` accepts; ``entry``: each sequence's batch entry (its starts count within it;
    default: all in entry 0, group mode). Tiles longest first."""
    q_start, q_len, k_start, k_len, lse_start, total_q = starts
    q_start, q_len = np.asarray(q_start, np.int64), np.asarray(q_len, np.int64)
    k_start, k_len = np.asarray(k_start, np.int64), np.asarray(k_len, np.int64)
    lse_start = np.asarray(lse_start, np.int64)
    entry = np.zeros(len(q_len), np.int64) if entry is None else np.asarray(entry, np.int64)
    rows, group, ew, step = (int(info[k]) for k in ("rows", "group", "ew", "step"))
    pos = rows // group
    desc = descriptors(mask, q_len, k_len).astype(np.int64)  # (ql, kl, y, x) per sequence, clipped
    y, x = desc[:, 2], desc[:, 3]
    per = -(-q_len // pos)
    b = np.repeat(np.arange(len(q_len)), per)
    first = np.arange(int(per.sum())) - np.repeat(np.cumsum(per) - per, per)
    p0 = first * pos
    last = np.minimum(p0 + pos, q_len[b]) - 1
    lo, nk, nl, ne = _key_spans(p0, last, y[b], x[b], k_len[b], step)
    assert (ne <= ew).all(), "an edge wider than the module's bound"
    q0 = np.minimum(q_start[b] + p0, tq - pos)
    pos0 = q0 - q_start[b]
    # the edge keys of the tile's first pos // 2 positions (pos0 on; the keys a row sees after the
    # interior grow with its position): the left slope, then those after the interior in whole steps
    nh = np.minimum(_edge_keys(_hi(np.minimum(pos0 + pos // 2 - 1, last), x[b], k_len[b]), lo, nk, nl, step), ne)
    cols = {"q0": q0, "k0": k_start[b], "nk": nk, "ne": ne, "pos0": pos0, "kl": k_len[b], "x": x[b], "entry": entry[b],
            "y": y[b], "lo": lo, "nl": nl, "nh": nh}
    table = np.stack([cols[name] for name in TILE_COLUMNS], axis=1)
    order = np.argsort(-(nk + ne), kind="stable")
    table, b, p0, last, pos0 = table[order], b[order], p0[order], last[order], pos0[order]
    n = len(table)
    count = last - p0 + 1
    tile = np.repeat(np.arange(n), count)
    p = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count) + np.repeat(p0, count)
    src = tile * pos + (p - np.repeat(pos0, count))
    out_map = np.full((int(entry.max(initial=0)) + 1) * tq, -1, np.int64)
    out_map[entry[b][tile] * tq + q_start[b][tile] + p] = src
    lse_map = np.full(int(total_q), -1, np.int64)
    lse_map[lse_start[b][tile] + p] = src
    idx = np.concatenate([table.ravel(), out_map, lse_map]).astype(np.int32)
    return idx, n, max(int(ne.max(initial=0)), step)


def _key_spans(p0, last, y, x, kl, step: int):
    """(lo, nk, nl, ne) of tiles whose rows are ``p0 .. last``: the interior ``[lo, lo + nk)``, the
    keys every row sees (CK: row ``i`` sees ``max(i - y + 1, 0) <= j < min(i + x, kl)``) in whole
    steps, and the edge of ``ne`` keys in whole steps, ``nl`` of them before the interior; where no
    step fits every row, the interior is empty and the edge all of the tile's keys."""
    lo_first, lo_last = np.maximum(p0 - y + 1, 0), np.maximum(last - y + 1, 0)
    hi_first, hi_last = _hi(p0, x, kl), _hi(last, x, kl)
    nk = np.maximum(hi_first - lo_last, 0) // step * step
    inner = nk > 0
    lo = np.where(inner, lo_last, np.minimum(lo_first, hi_last))
    nl = np.where(inner, -(-(lo - lo_first) // step) * step, 0)
    return lo, nk, nl, _edge_keys(hi_last, lo, nk, nl, step)


def _hi(row, x, kl):
    """The end of the keys row ``row`` sees (CK: ``min(row + x, kl)``, at least 0)."""
    return np.clip(np.minimum(row + x, kl), 0, None)


def _edge_keys(hi, lo, nk, nl, step: int):
    """The edge keys of rows whose keys end at most at ``hi``: the ``nl`` of the left slope, then
    those after the interior ``[lo, lo + nk)`` in whole steps."""
    return nl + np.maximum(-(-(hi - lo - nk) // step) * step, 0)


def module_tiles(module) -> dict | None:
    """The module's ``tiles`` record where it has ``fwd_tiles``."""
    return (getattr(module, "dense", None) or {}).get("tiles") if module.has("fwd_tiles") else None


def tiles_call(module, mask, starts, q_shape, k_shape, *, dtype: str, scale: float) -> FrameCall | None:
    """The ``fwd_tiles`` call of this group-mode problem on ``module`` (tensors ``[1, T, H, D]``),
    or None where :func:`refusal` gives a reason. Its LSE is ``[1, Hq, total]``."""
    info = module_tiles(module)
    tq, tk = int(q_shape[1]), int(k_shape[1])
    if refusal(info, starts, tq, tk) is not None:
        return None
    idx, n, e = tile_table(info, mask, starts, tq)
    return FrameCall("fwd_tiles", idx, (float(scale), n, 1, int(starts[-1]), e), dtype)


# Batches without cu_seqlen padding that fwd_tiles takes over fwd: square causal ones of at least
# this many rows. H200, f16 D128 H16 (2026-12-05, docs/BENCHMARKS.md): the tiles' kernels took
# 1.809 / 1.089 ms at B4 S4096 / S3000 causal where fwd's whole call took 2.08 / 1.33 (margins of
# 0.24-0.27 ms for the edges' copies and the output gather the kernel figures leave out); at S1000
# unmasked 0.270 against 0.28 (no margin), and shorter or chunked (Sq < Sk) shapes were not timed.
SQUARE_CAUSAL_MIN = 2048


def batch_pays(p) -> bool:
    """Whether a batch ``p`` (``spec.BatchProblem``) runs faster on ``fwd_tiles`` than on ``fwd``
    as measured: with ``cu_seqlen`` padding (``fwd``'s alternative is the padded frame), or square
    and causal from ``SQUARE_CAUSAL_MIN`` rows (``SQUARE_CAUSAL_MIN``'s comment). Causal means
    every row sees from key 0: a sliding window (whose right edge is causal's too) keeps ``fwd``'s
    banded path, measured faster for it (H100, 2026-12-05: 1.241 against 1.399 ms at B4 S4096
    ``b:1024,0``; docs/tried.md, "batch-mode windows through fwd_tiles")."""
    if (p.q_lens != p.sq).any() or (p.k_lens != p.sk).any():
        return True
    y, x = p.mask.coords(p.sq, p.sk)
    return p.sq == p.sk >= SQUARE_CAUSAL_MIN and x == 1 and y >= p.sk


def paged_call(module, mask, starts, pages, q_shape, *, dtype: str, scale: float) -> FrameCall | None:
    """The ``fwd_tiles_paged`` call of a group-mode problem over a paged cache (``pages``: each
    sequence's pages as the cache row of their first key and the page size,
    ``frames.paged_bases``), or None where the module lacks it or :func:`refusal` gives a reason:
    the used keys are gathered in sequence order first, then the tiles run as over packed keys."""
    info = module_tiles(module) if module.has("fwd_tiles_paged") else None
    bases, page = pages
    k_len = np.asarray(starts[3], np.int64)
    total_k = int(k_len.sum())
    packed = (*starts[:2], np.concatenate([[0], np.cumsum(k_len)[:-1]]).astype(np.int64), *starts[3:])
    tq = int(q_shape[1])
    if refusal(info, packed, tq, total_k) is not None:
        return None
    idx, n, e = tile_table(info, mask, packed, tq)
    seq = np.repeat(np.arange(len(k_len)), k_len)
    j = np.arange(total_k) - np.repeat(packed[2], k_len)
    rows = np.asarray(bases, np.int64)[seq, j // page] + j % page
    return FrameCall("fwd_tiles_paged", np.concatenate([idx, rows.astype(np.int32)]),
                     (float(scale), n, 1, int(starts[-1]), e, total_k), dtype)


def batch_starts(q_lens, k_lens, sq: int):
    """A batch's entries as sequences (``check_varlen``'s starts: each at row 0 of its entry, its
    LSE rows ``b * Sq + i``) and their entries."""
    q_lens, k_lens = np.asarray(q_lens, np.int64), np.asarray(k_lens, np.int64)
    zero = np.zeros(len(q_lens), np.int64)
    return (zero, q_lens, zero, k_lens, np.arange(len(q_lens)) * sq, len(q_lens) * sq), np.arange(len(q_lens))


def batch_call(module, p, *, dtype: str, scale: float) -> FrameCall:
    """The ``fwd_tiles`` call of a batch-mode problem ``p`` (``spec.BatchProblem``; each entry its
    own lengths) that :func:`refusal` accepts; its LSE is ``[B, Hq, Sq]``."""
    starts, entry = batch_starts(p.q_lens, p.k_lens, p.sq)
    idx, n, e = tile_table(module_tiles(module), p.mask, starts, p.sq, entry)
    return FrameCall("fwd_tiles", idx, (float(scale), n, p.batch, p.sq, e), dtype)
