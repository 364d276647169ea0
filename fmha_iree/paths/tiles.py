"""The tiles path: ``fwd_tiles`` / ``fwd_tiles_paged`` (``kernels.tiles``), CK's one-launch form.
A problem's sequences (group mode's, a batch's entries, a paged cache's) are cut into tiles of
query rows, each with its own key counts, written as one index table per batch composition
(:func:`tile_table`); each tile runs over its own keys (the interior every row sees, read in place,
then the edge, masked). A paged cache's used keys are gathered in sequence order first.
"""

from __future__ import annotations

import numpy as np

from ..problem.abi import EDGE_PARTS, PIECE_ROWS, TILE_COLUMNS
from ..problem.alibi import frame_offset
from .base import Problem, Refused
from .capabilities import Capabilities, TilesCaps
from .frame import TableCall, descriptors, paged_bases
from .policy import SQUARE_CAUSAL_MIN

__all__ = ["TILES", "MAX_TILES", "tile_table", "reasons", "batch_starts", "alibi_extent"]

# tiles run along the grid's y dim (heads along x, so the longest tiles of every head start first),
# at most 65535 workgroups on CUDA and HIP; the edge launches EDGE_PARTS workgroups a tile
MAX_TILES = 65535 // EDGE_PARTS


def reasons(info: TilesCaps, q_len: np.ndarray, tq: int, tk: int, alibi: bool = False) -> list[str]:
    """Why ``fwd_tiles`` cannot take sequences of ``q_len`` query rows over packed Q and K of
    ``tq`` / ``tk`` rows (none where it can). ``alibi``: an ALiBi module's, the only path there
    (its tiles copy Q, so any rows)."""
    out = []
    if tq < info.positions and not alibi:
        out.append(f"fewer query rows ({tq}) than a tile's {info.positions} (the tiles read whole tiles of Q in place)")
    if tk < 1 or not (q_len > 0).any():
        out.append("no query rows or no keys")
    elif int(q_len.max()) * info.group <= PIECE_ROWS and not alibi:
        out.append("decode-shaped (a few query rows per sequence): split-KV pieces (packed) serve it")
    if int((-(-q_len // info.positions)).sum()) > MAX_TILES:
        out.append(f"more than {MAX_TILES} tiles (the grid's second dim on CUDA and HIP, two workgroups a tile's edge)")
    return out


def tile_table(info: TilesCaps, mask, starts, tq: int, entry=None, slope_row=None, bias_rows: int | None = None
               ) -> tuple[np.ndarray, int, int]:
    """(the index table: tiles ``[N, TILE_COLUMNS]``, the out rows' map ``[B * tq]``, the LSE
    rows' map ``[total]``; N; the widest edge's keys, at least one step) for a problem the path
    takes (:func:`reasons`); ``entry``: each sequence's batch entry (its starts count within it;
    default: all in entry 0, group mode). Tiles longest first. ``slope_row``: each sequence's row
    of the ALiBi slopes (or its first bias plane), whose tiles copy Q (a tile's rows then start at
    its first position, never shifted back to stay inside Q); ``bias_rows``: a bias's positions
    (``problem.bias.KernelBias``), inside which a tile's rows are shifted back instead."""
    q_start, q_len, k_start, k_len, lse_start, total_q = starts
    q_start, q_len = np.asarray(q_start, np.int64), np.asarray(q_len, np.int64)
    k_start, k_len = np.asarray(k_start, np.int64), np.asarray(k_len, np.int64)
    lse_start = np.asarray(lse_start, np.int64)
    entry = np.zeros(len(q_len), np.int64) if entry is None else np.asarray(entry, np.int64)
    rows, group, ew, step = info.rows, info.group, info.ew, info.step
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
    if bias_rows is not None:
        q0 = q_start[b] + np.minimum(p0, bias_rows - pos)
    else:
        q0 = q_start[b] + p0 if slope_row is not None else np.minimum(q_start[b] + p0, tq - pos)
    pos0 = q0 - q_start[b]
    a0 = pos0 + frame_offset(mask, q_len, k_len)[b]  # ALiBi's zero point of the tile's first row
    sr = np.zeros_like(b) if slope_row is None else np.asarray(slope_row, np.int64)[b]
    # the edge keys of the tile's first pos // 2 positions (pos0 on; the keys a row sees after the
    # interior grow with its position): the left slope, then those after the interior in whole steps
    nh = np.minimum(_edge_keys(_hi(np.minimum(pos0 + pos // 2 - 1, last), x[b], k_len[b]), lo, nk, nl, step), ne)
    cols = {"q0": q0, "k0": k_start[b], "nk": nk, "ne": ne, "pos0": pos0, "kl": k_len[b], "x": x[b], "entry": entry[b],
            "y": y[b], "lo": lo, "nl": nl, "nh": nh, "a0": a0, "sr": sr}
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


def alibi_extent(idx: np.ndarray, n: int) -> tuple[int, str | None]:
    """(``AL``: the interiors' bias ramps reach from every interior's first key, a reason where
    some interior holds keys right of its first row's position): the interior adds ``slope * (key
    - a0)`` (``kernels.tile_io._alibi_edges``), ALiBi only for keys at or left of every row's."""
    t = idx[: n * len(TILE_COLUMNS)].reshape(n, len(TILE_COLUMNS)).astype(np.int64)
    col = {name: t[:, i] for i, name in enumerate(TILE_COLUMNS)}
    inner = col["nk"] > 0
    if (col["lo"] + col["nk"] - 1 > col["a0"])[inner].any():
        return 0, ("alibi_slopes: rows that see keys right of their position in the mask's frame across a whole "
                   "tile (no mask or a window's right side, beyond decode): not supported yet; causal masks, "
                   "windows without a right side and decode are")
    return int(max((col["a0"] - col["lo"])[inner].max(initial=0), 0)) + 1, None


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


def batch_starts(q_lens, k_lens, sq: int):
    """A batch's entries as sequences (``check_varlen``'s starts: each at row 0 of its entry, its
    LSE rows ``b * Sq + i``) and their entries."""
    q_lens, k_lens = np.asarray(q_lens, np.int64), np.asarray(k_lens, np.int64)
    zero = np.zeros(len(q_lens), np.int64)
    return (zero, q_lens, zero, k_lens, np.arange(len(q_lens)) * sq, len(q_lens) * sq), np.arange(len(q_lens))


def _batch_is_slower(prob: Problem) -> str | None:
    """Why a batch runs faster elsewhere than on the tiles, as measured (``SQUARE_CAUSAL_MIN``):
    with cu_seqlen padding the tiles win (the alternative is the padded frame); without, only square
    causal batches from ``SQUARE_CAUSAL_MIN`` rows. Causal means every row sees from key 0: a
    sliding window keeps ``fwd``'s banded path."""
    if prob.padded:
        return None
    p = prob.p
    y, x = p.mask.coords(p.sq, p.sk)
    if p.sq == p.sk >= SQUARE_CAUSAL_MIN and x == 1 and y >= p.sk:
        return None
    return (f"fwd was measured faster for batches without cu_seqlen padding but square causal ones of at least "
            f"{SQUARE_CAUSAL_MIN} rows (policy.SQUARE_CAUSAL_MIN)")


class _Tiles:
    name = "tiles"
    modes = ("batch", "group", "paged")

    def plan(self, prob: Problem, caps: Capabilities):
        entry = "fwd_tiles_paged" if prob.mode == "paged" else "fwd_tiles"
        info = caps.key_tiles
        if info is not None and info.short is not None and int(prob.q_len.max(initial=0)) <= info.short.positions:
            # decode-shaped: a 16-row tile a sequence (the 128-row ones computed 128 rows for one;
            # docs/BENCHMARKS.md, "ALiBi")
            entry, info = entry.replace("fwd_tiles", "fwd_tiles_short"), info.short
        if info is None or not caps.has(entry):
            return Refused((f"the module has no {entry} (a CPU module, padded head dims, or a gfx target and head "
                            "dim whose tiles spilled or failed to compile: source._rocm_tiles)",))
        p = prob.p
        alibi, bias = p.alibi is not None, p.bias
        why, starts, entries, tk = _sequences(prob, alibi or bias is not None)
        found = ([why] if why else []) + reasons(info, np.asarray(starts[1], np.int64), p.sq, tk,
                                                 alibi or bias is not None)
        if bias is not None and bias.positions < info.positions:
            found.append(f"bias: its planes hold {bias.positions} positions, fewer than a tile's {info.positions}")
        if found:
            return Refused(tuple(found))
        rows = _variant_rows(p, len(starts[1]))
        idx, n, e = tile_table(info, p.mask, starts, p.sq, entries, rows, None if bias is None else bias.positions)
        scalars = (float(p.scale), n, p.batch, p.sq, e) if prob.mode == "batch" else \
            (float(p.scale), n, 1, int(starts[-1]), e)
        if prob.mode == "paged":
            idx = np.concatenate([idx, _paged_rows(prob, starts)])
            scalars += (tk,)
        if alibi:
            extent, bad = alibi_extent(idx, n)
            if bad:
                return Refused((bad,))
            scalars += (extent,)
        if bias is not None:
            scalars += (bias.head_stride,)
        note = ", with ALiBi" if alibi else (", with a bias" if bias is not None else "")
        return TableCall(entry, idx, scalars, p.q.dtype, (prob.out_shape, prob.lse_shape),
                         note="each tile of query rows over its own keys" + note,
                         slopes=p.alibi.ravel() if alibi else None, bias=None if bias is None else bias.array)


def _sequences(prob: Problem, variant: bool):
    """(why the batch runs faster elsewhere, the sequences' starts, their batch entries, the keys'
    rows) of a problem; ``variant``: an ALiBi or bias module's, the only path there."""
    p = prob.p
    if prob.mode == "batch":
        starts, entries = batch_starts(p.q_lens, p.k_lens, p.sq)
        return None if variant else _batch_is_slower(prob), starts, entries, p.sk
    if prob.mode != "paged":
        return None, prob.starts, None, p.sk
    k_len = prob.k_len
    starts = (*prob.starts[:2], np.concatenate([[0], np.cumsum(k_len)[:-1]]).astype(np.int64), *prob.starts[3:])
    return None, starts, None, int(k_len.sum())


def _variant_rows(p, n: int) -> np.ndarray | None:
    """Each sequence's row of the ALiBi slopes (``[1, Hq]``: every sequence row 0; ``[B, Hq]``:
    sequence b row b) or first bias plane; None for neither."""
    if p.alibi is not None:
        return np.zeros(n, np.int64) if len(p.alibi) == 1 else np.arange(n)
    return None if p.bias is None else p.bias.plane_base(np.arange(n))


def _paged_rows(prob: Problem, packed) -> np.ndarray:
    """The cache row of each used key in sequence order (``fwd_tiles_paged`` gathers them first)."""
    cache = prob.cache
    k_len = prob.k_len
    bases = paged_bases(cache.block_table, cache.page_size, cache.lens)
    seq = np.repeat(np.arange(len(k_len)), k_len)
    j = np.arange(int(k_len.sum())) - np.repeat(packed[2], k_len)
    return (np.asarray(bases, np.int64)[seq, j // cache.page_size] + j % cache.page_size).astype(np.int32)


TILES = _Tiles()
