"""What a CPU module's calls need beyond the one-call routes (the dispatch stage, below ``dispatch``):
which queries ``rows`` takes (``rows_fit``); group mode (``varlen_calls``): sequences of a few
queries in ``rows_packed`` groups of similar key counts, the others up to ``WAVE_MAX_ROWS`` rows in
one ``waves_varlen`` call, the longer ones (and a bshd batch with ``cu_seqlen`` padding) in one
``units_varlen`` call; modules without ``waves_varlen`` put short sequences in ``rows`` groups;
and the results of an empty problem.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from . import frames
from .device import DeviceTensor, aligned_empty
from .paged import PagedCache
from .plan import runs, unit_tiles, wave_tables
from .tiles import CPU_WAVE_KEYS, CPU_WAVE_ROWS
from .spec import BatchProblem

__all__ = ["ROWS_MAX_ROWS", "ROWS_MAX_SCORES", "PAD_LIMIT", "GROUP_KEYS", "WAVE_MAX_ROWS", "BATCH_WAVE_MIN_ROWS",
           "BATCH_WAVE_MAX_KEYS", "as_group_mode", "empty_result", "packed_fits",
           "rows_fit", "rows_desc", "short_sequences", "paged_groups", "units_varlen_call", "waves_call", "varlen_calls",
           "rows_group", "batch_as_group"]


def empty_result(p: BatchProblem, out_shape, lse_shape):
    dt = {"f16": np.float16, "bf16": np.int16, "f32": np.float32}[p.q.dtype]
    out, lse = np.zeros(out_shape, dt), np.full(lse_shape, -np.inf, np.float32)
    if p.q.on_device:
        uri = p.q.array.device_uri
        return DeviceTensor.from_host(out, p.q.dtype, uri), DeviceTensor.from_host(lse, "f32", uri)
    return out, lse


# The CPU's ``rows`` entry point (rows.Rows) holds every score of a call, so it takes short
# queries: at most ROWS_MAX_ROWS query rows per KV head (G * Sq). Dev CPU (2 cores, f32 D=64,
# 2026-12-01, docs/BENCHMARKS.md): decode B4 Hq32 Hk8 Sq1 Sk4096 17 ms against 412 through the
# tile plan; H8 Sk2048 against the plan: Sq64 13 vs 17 ms, Sq128 21 vs 20, Sq256 40 vs 31, Sq512
# 94 vs 49 (every key of every row is scored, no block is skipped).
ROWS_MAX_ROWS = 128
ROWS_MAX_SCORES = 1 << 25  # 128 MiB of f32 scores (and as much for their exponentials)
# Group mode's short sequences take ``rows_packed`` up to this many query rows per sequence
# (``packed_fits``), ``rows_kpad`` above. Dev CPU (f32 D64, 32 sequences, 2026-12-04, after
# rows_packed's 64-wide vectors and rows' batched P V; docs/BENCHMARKS.md), rows_packed /
# rows_kpad ms by query rows per KV head, keys 256..4096 / 64..512: G=1 (H8) 4 rows 137 / 313,
# 8 rows 240 / 368 and 36 / 58, 16 rows 441 / 344 and 63 / 57; G=2 (H16 Hk8) 16 rows 192 / 395
# and 33 / 68, 32 rows 408 / 504 and 59 / 77; G=4 (H32 Hk8) 16 rows 184 / 419, 32 rows 274 / 468
# and 39 / 72, 64 rows 476 / 603 and 92 / 131. rows_packed computes each query row against its
# keys alone (its P V gathers V per row: docs/tried.md), so without GQA it loses sooner
# (docs/bench/cpu_2026-12-04_packed_crossover.txt).
PACKED_MAX_QUERIES = 16
PACKED_MAX_QUERIES_MHA = 8  # G = 1
PACKED_MAX_ROWS = 64  # query rows per KV head: the most measured


def packed_fits(max_qlen: int, group: int) -> bool:
    """Whether sequences of at most ``max_qlen`` query rows take ``rows_packed`` (``PACKED_MAX_QUERIES``)."""
    most = PACKED_MAX_QUERIES if group > 1 else PACKED_MAX_QUERIES_MHA
    return max_qlen <= most and max_qlen * group <= PACKED_MAX_ROWS


def rows_fit(p: BatchProblem, module) -> bool:
    """Whether ``module``'s ``rows`` entry point takes the problem: a CPU module, short queries
    (``ROWS_MAX_ROWS`` rows per KV head) and at most ``ROWS_MAX_SCORES`` scores."""
    return bool(getattr(module, "has_rows", False)) and p.sq * (p.hq // p.hk) <= ROWS_MAX_ROWS and \
        p.batch * p.hq * p.sq * p.sk <= ROWS_MAX_SCORES


# A bshd batch-mode problem with at least BATCH_WAVE_MIN_ROWS query rows and at most
# BATCH_WAVE_MAX_KEYS keys runs as group mode (each batch entry a sequence; ``varlen_calls``)
# rather than through ``rows`` or ``units``. Dev CPU, 2026-12-05 (f32 D64 causal, min of 5 calls,
# a script outside the repository), ms as group mode / by the batch-mode route (torch's CPU SDPA):
# B32 H8 S128 13.1 / 47.2 rows (5.0), S256 53.3 / 70.3 units (19.9), B16 S384 35.3 / 63.5 (19.6),
# B8 S512 23.9 / 25.9 (16.4), B4 H32/8 Sq128 Sk1024 32.6 / 50.3 (23.6 with a bool mask); the
# other way: B64 S32 9.5 / 7.1 rows (1.0), chunked prefill B1 H8 Sq256 Sk2048 10.1 / 7.2 units
# (5.4), B2 Sq512 Sk4096 66.6 / 46.9 (42.7), B4 H32/8 Sq256 Sk2048 110 / 97 (81).
BATCH_WAVE_MIN_ROWS = 64
BATCH_WAVE_MAX_KEYS = 1024


def as_group_mode(p: BatchProblem, module) -> bool:
    """Whether a batch-mode problem runs as group mode on ``module``: a batch on host inputs,
    ``BATCH_WAVE_MIN_ROWS`` or more query rows (bhsd: at most ``WAVE_MAX_ROWS``, all in
    ``waves_varlen``) against at most ``BATCH_WAVE_MAX_KEYS`` keys, on a module with
    ``waves_varlen``."""
    return (not p.q.on_device and module.has("waves_varlen") and BATCH_WAVE_MIN_ROWS <= p.sq and p.sk <= BATCH_WAVE_MAX_KEYS
            and (p.layout == "bshd" or p.sq <= WAVE_MAX_ROWS))


def rows_desc(p: BatchProblem) -> np.ndarray:
    """``rows``' per-batch descriptor: (qlen, klen, y, x) with CK's coordinates for the batch's
    own lengths (``rows.ROWS_DESC_COLUMNS``)."""
    return frames.descriptors(p.mask, p.q_lens, p.k_lens)


def short_sequences(p: BatchProblem, q_len: np.ndarray, k_len: np.ndarray) -> list[np.ndarray]:
    """Group mode: the sequences ``rows`` serves (at most ``ROWS_MAX_ROWS`` query rows per KV
    head, at least one query and one key), in groups of similar key counts (a call computes every
    sequence of its group up to the group's longest keys: ``_closes_group``), each group's padded
    batch within ``ROWS_MAX_SCORES`` scores. Returns index arrays, one per ``rows`` call."""
    g = p.hq // p.hk
    ok = np.flatnonzero((q_len * g <= ROWS_MAX_ROWS) & (q_len > 0) & (k_len > 0)
                        & (p.hq * q_len * k_len <= ROWS_MAX_SCORES))
    groups, cur, most_q, keys = [], [], 0, 0
    for i in ok[np.argsort(k_len[ok], kind="stable")]:  # ascending keys: the last one is the longest
        k_i = int(k_len[i])
        if cur and ((len(cur) + 1) * p.hq * max(most_q, int(q_len[i])) * k_i > ROWS_MAX_SCORES
                    or _closes_group(len(cur), keys, k_i)):
            groups.append(np.array(cur))
            cur, most_q, keys = [], 0, 0
        cur.append(i)
        most_q, keys = max(most_q, int(q_len[i])), keys + k_i
    return groups + ([np.array(cur)] if cur else [])


# A group of short sequences is computed up to its longest keys (padding keys read the sequence's
# last key, cached, so the cost is compute, not memory). Dev CPU, 2026-12-04 (f32 D64 Hq32 Hk8, a
# decode of 32 sequences with keys 256..4096, min of 5 calls; a script outside the repository):
# one group 68.9 / 69.3 ms; PAD_LIMIT / GROUP_KEYS 1.25 / 8192 (3 groups) 63.0 / 63.5, 1.25 / 4096
# (4) 64.7 / 62.5, 1.5 / 8192 (2) 64.9, 1.25 / 16384 (2) 64.7, 1.1 / 4096 (6) 62.4.
PAD_LIMIT = 1.25
GROUP_KEYS = 8192


def _closes_group(n: int, keys: int, k_next: int) -> bool:
    """Whether a group of ``n`` sequences with ``keys`` keys in all stops before a sequence of
    ``k_next`` keys (at least as many as any in the group): padding all of them to ``k_next``
    would compute more than ``PAD_LIMIT`` times their own keys, and the group already holds
    ``GROUP_KEYS`` keys (a call's fixed cost is then small against its work)."""
    return (n + 1) * k_next > PAD_LIMIT * (keys + k_next) and keys >= GROUP_KEYS


def paged_groups(p: BatchProblem, starts, module) -> list[np.ndarray] | None:
    """The ``rows_packed_pages`` calls of a group-mode problem over a paged cache on a CPU module
    (:func:`short_sequences`' groups), or None where the module lacks it or a sequence with work
    needs the tile plan (more query rows than ``packed_fits`` takes)."""
    if module is None or not module.has("rows_packed_pages") or p.q.on_device:
        return None
    q_len, k_len = starts[1], starts[3]
    groups = short_sequences(p, q_len, k_len)
    left = (q_len > 0) & (k_len > 0)
    for group in groups:
        left[group] = False
    if left.any() or not all(packed_fits(int(q_len[g].max()), p.hq // p.hk) for g in groups):
        return None
    return groups


def units_varlen_call(p: BatchProblem, module, seqs: np.ndarray, starts, rows: int):
    """The sequences ``seqs`` of a group-mode problem (with query rows; one without keys gets out 0
    and lse -inf from its tiles) in one ``units_varlen`` call over the span of packed rows and keys
    they occupy, read in place. Returns (out ``[Tq, Hq, Dv]``, lse ``[Hq, total]``) with ``seqs``'
    rows written and the others 0 / -inf, for the caller to write (``_collected``)."""
    total_q = starts[5]
    if not len(seqs):
        return empty_result(p, (p.sq, p.hq, p.dv), (p.hq, total_q))
    (q_start, q_len, k_start, k_len, lse_start), (qa, qb, ka, kb), desc = _span(p, seqs, starts)
    table = unit_tiles((q_start - qa, q_len, k_start - ka, k_len), (desc[:, 2], desc[:, 3]), rows=rows,
                       group=p.hq // p.hk)
    o, l = module.run_tables("units_varlen", p.q.array[:, qa:qb], p.k.array[:, ka:kb], p.v.array[:, ka:kb],
                             p.q.dtype, p.scale, host=table)
    return _collected(p, (o[0], l[0]), (qa, qb), (q_start, q_len, lse_start), total_q)


# Group mode's sequences of at most this many query rows take ``waves_varlen``, longer ones
# ``units_varlen``. Dev CPU, 2026-12-05 (f32 H8 D64 causal, min of 5 calls, a script outside the
# repository), ms with the bound at 256 / 512: 32 x 1..128 rows 13.6 / 9.1, 64 x 200..300 120 /
# 118, 32 x 256..512 112 / 100, 16 x 128..1023 103 / 98, 1 x 2048 28 / 27 (waves alone 40).
WAVE_MAX_ROWS = 512


def varlen_calls(p: BatchProblem, module, starts, rows: int):
    """A group-mode problem on a CPU module with ``waves_varlen``: sequences of a few queries in
    ``rows_packed`` groups (``short_sequences``, ``packed_fits``), the other sequences with query
    rows up to ``WAVE_MAX_ROWS`` in one ``waves_varlen`` call, the longer ones in one
    ``units_varlen`` call of ``rows``-row tiles. Returns (out ``[Tq, Hq, Dv]``, lse ``[Hq, total]``)."""
    q_len, k_len = starts[1], starts[3]
    g = p.hq // p.hk
    groups = [s for s in short_sequences(p, q_len, k_len) if packed_fits(int(q_len[s].max()), g)] \
        if module.has("rows_packed") else []
    rest = q_len > 0
    for s in groups:
        rest[s] = False
    long = _long_sequences(rest, starts[0], q_len)
    out = lse = None
    if long.any():
        out, lse = units_varlen_call(p, module, np.flatnonzero(long), starts, rows)
    out, lse = waves_call(p, module, np.flatnonzero(rest & ~long), starts, out, lse)
    for s in groups:
        rows_group(p, module, s, starts, out, lse)
    return out, lse


def _long_sequences(rest: np.ndarray, q_start: np.ndarray, q_len: np.ndarray) -> np.ndarray:
    """Which of the sequences ``rest`` go to ``units_varlen``: those over ``WAVE_MAX_ROWS`` rows,
    unless they lie among the others (each call copies K / V over the span of rows and keys its
    sequences occupy, so interleaved calls copy them twice); then the kind with more rows takes
    them all. Dev CPU, 2026-12-05 (f32 H8 D64 causal, min of 5 calls), ms for units_varlen only /
    the split / waves_varlen only: 64 sequences of 200..300 rows 142 / 200 / 129, 16 of 128..1023
    103 / 111 / 122; 1 x 2048 then 32 x 64 47 / 39 / 47."""
    long = rest & (q_len > WAVE_MAX_ROWS)
    short = rest & ~long
    if not long.any() or not short.any():
        return long
    ends = q_start + q_len
    spans = [(int(q_start[m].min()), int(ends[m].max())) for m in (long, short)]
    if spans[0][1] <= spans[1][0] or spans[1][1] <= spans[0][0]:
        return long
    return rest if q_len[long].sum() >= q_len[short].sum() else np.zeros_like(rest)


def waves_call(p: BatchProblem, module, seqs: np.ndarray, starts, out: np.ndarray | None = None,
               lse: np.ndarray | None = None):
    """The sequences ``seqs`` of a group-mode problem in one ``waves_varlen`` call over the span of
    packed rows and keys they occupy (read in place), their rows written into ``out`` / ``lse``
    (``[Tq, Hq, Dv]``, ``[Hq, total]``). Without ``out``, returns the call's own arrays where they
    are the problem's (its span is every packed row, each row's LSE column its own index: rows no
    sequence of ``seqs`` owns are 0 / -inf there), else new ones (``_collected``). Returns (out, lse)."""
    total_q = starts[5]
    if not len(seqs):
        return (out, lse) if out is not None else empty_result(p, (p.sq, p.hq, p.dv), (p.hq, total_q))
    (q_start, q_len, k_start, k_len, lse_start), (qa, qb, ka, kb), desc = _span(p, seqs, starts)
    o, l = _run_waves(p, module, (p.q.array[:, qa:qb], p.k.array[:, ka:kb], p.v.array[:, ka:kb]),
                      (q_start - qa, q_len, k_start - ka, k_len), desc, qb - qa)
    return _collected(p, (o[0], l[0]), (qa, qb), (q_start, q_len, lse_start), total_q, out, lse)


def _collected(p: BatchProblem, res: tuple, span: tuple[int, int], seqs: tuple, total_q: int,
               out: np.ndarray | None = None, lse: np.ndarray | None = None):
    """A call's results ``res`` (out ``[rows, Hq, Dv]``, lse ``[Hq, rows]`` over the packed rows
    ``span``, rows of no sequence of the call 0 / -inf) as the problem's (out, lse): the call's own
    arrays where its span is every packed row and each row's LSE column its own index, else its
    sequences' rows (``seqs`` = (q_start, q_len, lse_start)) written into ``out`` / ``lse`` (new
    ones, 0 / -inf, where not given)."""
    qa, qb = span
    if out is None:
        if (qa, qb) == (0, p.sq) and total_q == p.sq and np.array_equal(seqs[2], seqs[0]):
            return res
        out, lse = empty_result(p, (p.sq, p.hq, p.dv), (p.hq, total_q))
    _place(out, lse, res[0], res[1], qa, seqs)
    return out, lse


def _run_waves(p: BatchProblem, module, qkv: tuple, starts: tuple, desc: np.ndarray, total_q: int):
    """One ``waves_varlen`` call on ``qkv`` (tokens t = b S + s) for the sequences ``starts`` =
    (q_start, q_len, k_start, k_len) with descriptors ``desc`` (``frames.descriptors``), over
    ``total_q`` rows. Returns (out, lse) as the module gives them."""
    w = wave_tables(starts, (desc[:, 2], desc[:, 3]), total_q, rows=CPU_WAVE_ROWS, chunk=CPU_WAVE_KEYS,
                    group=p.hq // p.hk)
    return module.run_tables("waves_varlen", *qkv, p.q.dtype, p.scale, (w.chunks, w.slots, w.steps, w.rowslot),
                             w.levels)


def _span(p: BatchProblem, seqs: np.ndarray, starts):
    """The sequences ``seqs``' (q_start, q_len, k_start, k_len, lse_start), the packed rows
    ``[qa, qb)`` and keys ``[ka, kb)`` they occupy (at least one key, inside the keys), and their
    descriptors (``frames.descriptors``)."""
    q_start, q_len, k_start, k_len, lse_start = (x[seqs] for x in starts[:5])
    qa, qb = int(q_start.min()), int((q_start + q_len).max())
    ka = min(int(k_start.min()), p.sk - 1)
    kb = max(int((k_start + k_len).max()), ka + 1)
    return (q_start, q_len, k_start, k_len, lse_start), (qa, qb, ka, kb), frames.descriptors(p.mask, q_len, k_len)


def _place(out: np.ndarray, lse: np.ndarray, o: np.ndarray, l: np.ndarray, qa: int, seqs: tuple):
    """Rows of a call over packed rows from ``qa`` on (``o`` [rows, Hq, Dv], ``l`` [Hq, rows]) into
    the problem's ``out`` / ``lse``, for sequences ``seqs`` = (q_start, q_len, lse_start): one slice
    where they fill the call's rows in order, else row by row."""
    q_start, q_len, lse_start = seqs
    ends = np.cumsum(q_len)
    if np.array_equal(q_start, qa + ends - q_len) and np.array_equal(lse_start, q_start):
        n = int(ends[-1])
        out[qa:qa + n], lse[:, qa:qa + n] = o[:n], l[:, :n]
        return
    seq, rel = runs(q_len)
    out[q_start[seq] + rel] = o[q_start[seq] - qa + rel]
    lse[:, lse_start[seq] + rel] = l[:, q_start[seq] - qa + rel]


def rows_group(p: BatchProblem, module, group: np.ndarray, starts, out: np.ndarray, lse: np.ndarray,
                cache: PagedCache | None = None):
    """Run the sequences ``group`` of a group-mode problem in one call, written back into the
    packed ``out`` ``[Tq, Hq, Dv]`` and ``lse`` ``[Hq, total]``: ``rows_packed`` where the module has
    it and the queries are few (``packed_fits``; K / V read where they lie, a paged ``cache``
    through its block table), else ``rows_kpad`` on copies gathered into a batch padded to their
    longest (rows past a sequence's lengths are masked, never read into the output)."""
    q_start, q_len, k_start, k_len, lse_start, _ = (x[group] if isinstance(x, np.ndarray) else x for x in starts)
    mq, mk = int(q_len.max()), int(k_len.max())
    desc = frames.descriptors(p.mask, q_len, k_len)
    if module.has("rows_packed") and packed_fits(mq, p.hq // p.hk):
        packed = np.concatenate([np.stack([q_start, q_len, k_start, k_len], 1), desc[:, 2:]], 1).astype(np.int32)
        kv = (cache.k.array, cache.v.array) if cache is not None else (p.k.array, p.v.array)
        table = cache.block_table[group] if cache is not None else None
        o, l = module.run_rows_packed(p.q.array, *kv, p.q.dtype, p.scale, packed, mq, mk, table)
    else:
        assert cache is None, "a paged cache's groups are all short (paged_groups)"
        qi = np.minimum(q_start[:, None] + np.arange(mq), p.sq - 1)
        ki = np.minimum(k_start[:, None] + np.arange(mk), p.sk - 1)
        q, k, v = (np.take(x.array[0], idx, axis=0, out=aligned_empty(idx.shape + x.array.shape[2:], x.array.dtype))
                   for x, idx in ((p.q, qi), (p.k, ki), (p.v, ki)))  # [n, S, H, D], bshd, read in place
        o, l = module.run_rows(q, k, v, p.q.dtype, p.scale, desc, padded_keys=True)
    rows, rel = runs(q_len)
    out[q_start[rows] + rel] = o[rows, rel]
    lse[:, lse_start[rows] + rel] = l[rows, :, rel].T


def batch_as_group(p: BatchProblem, module, rows: int):
    """A batch (``cu_seqlen`` padding or not) as group mode, batch entry ``b`` the sequence of
    tokens ``[b Sq, b Sq + q_len[b])`` (keys ``[b Sk, b Sk + k_len[b])``): one ``waves_varlen`` call
    on the batch as it lies where every entry has at most ``WAVE_MAX_ROWS`` rows, else (bshd) the
    batch viewed as ``[1, B S, H, D]`` through ``varlen_calls`` (one ``units_varlen`` call in
    modules without ``waves_varlen``). Returns (out, lse ``[B, Hq, Sq]``), rows past ``q_len[b]`` 0
    and -inf."""
    b, sq, sk = p.batch, p.sq, p.sk
    q_lens, k_lens = np.asarray(p.q_lens, np.int64), np.asarray(p.k_lens, np.int64)
    out_shape = (b, p.hq, sq, p.dv) if p.layout == "bhsd" else (b, sq, p.hq, p.dv)
    if not q_lens.any():  # no batch entry has query rows
        return empty_result(p, out_shape, (b, p.hq, sq))
    starts = (np.arange(b) * sq, q_lens, np.arange(b) * sk, k_lens, np.arange(b) * sq, b * sq)
    if module.has("waves_varlen") and int(q_lens.max()) <= WAVE_MAX_ROWS:
        return _run_waves(p, module, (p.q.array, p.k.array, p.v.array), starts[:4], rows_desc(p), b * sq)
    flat = [dataclasses.replace(x, array=x.array.reshape((1, -1) + x.array.shape[2:])) for x in (p.q, p.k, p.v)]
    pf = dataclasses.replace(p, q=flat[0], k=flat[1], v=flat[2], batch=1, sq=b * sq, sk=b * sk,
                             q_lens=q_lens.sum(keepdims=True), k_lens=k_lens.sum(keepdims=True))
    if module.has("waves_varlen"):
        o, l = varlen_calls(pf, module, starts, rows)
    else:
        o, l = units_varlen_call(pf, module, np.flatnonzero(q_lens > 0), starts, rows)
    return o.reshape(out_shape), l.reshape(p.hq, b, sq).transpose(1, 0, 2)
