"""Dispatch: which entry point of a loaded module runs a validated problem, and running it.

Shared by the API (:mod:`fmha_iree.api`) and deployed modules (:mod:`fmha_iree.deploy`). A batch-
mode problem takes a compiled-in or aligned one-call entry point that serves it (``dense_kind``;
in a module with ``fwd``, not the generic two-block ``causal``), else ``rows`` (CPU modules, short
queries: any lengths and mask, cu_seqlen padding too), else ``units`` (CPU modules: any lengths and
mask in one call, the plan's units looped inside the module), else ``fwd`` (CUDA modules: any
lengths and mask in one call) or, with cu_seqlen padding, ``fwd_ragged`` (:mod:`fmha_iree.frames`), else the
tile plan (``init``/``step``/``finalize``). Group mode and paged caches take ``fwd_ragged`` where
the module has it, else ``rows`` and the plan. :func:`route` says which and why.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from . import frames
from .frames import has_ragged
from .device import DeviceTensor, aligned_empty
from .plan import Plan, Sequences, build_plan, runs, state_tiles, unit_tiles, units_budget
from .runtime import dense_entry
from .paged import PagedCache
from .spec import BatchProblem, Operand, check_varlen

__all__ = ["Route", "route", "dense_kind", "uses_fwd", "run_batch", "run_varlen", "run_paged", "prepare", "has_ragged"]


@dataclasses.dataclass(frozen=True)
class Route:
    """The path a batch-mode call takes: ``path`` is ``"fwd"``, ``"units"``, ``"units_varlen"``, ``"ragged"``, ``"rows"``,
    ``"dense"``, ``"causal"``, ``"window"`` or ``"plan"``; ``entry`` the module function that runs it (None for the plan's
    ``init``/``step``/``finalize``); ``window`` the width of a ``"window"`` path; ``reason`` why
    this path and not an earlier one."""

    path: str
    reason: str
    entry: str | None = None
    window: int | None = None


def _wrap(array, like: Operand, dtype: str):
    """Return ``array`` in the caller's array type (torch, numpy, or a DeviceTensor left on the
    device) and dtype."""
    if like.on_device or not like.is_torch:
        return array
    import torch

    t = torch.from_numpy(np.ascontiguousarray(array))
    return t.view(torch.bfloat16) if dtype == "bf16" else t


def _empty_result(p: BatchProblem, out_shape, lse_shape):
    dt = {"f16": np.float16, "bf16": np.int16, "f32": np.float32}[p.q.dtype]
    out, lse = np.zeros(out_shape, dt), np.full(lse_shape, -np.inf, np.float32)
    if p.q.on_device:
        uri = p.q.array.device_uri
        return DeviceTensor.from_host(out, p.q.dtype, uri), DeviceTensor.from_host(lse, "f32", uri)
    return out, lse


def _execute(p: BatchProblem, seqs: Sequences, out_shape, lse_shape, out_rows_shape, lse_rows_shape, tiles, get_module,
             family: str):
    """Shared by batch and varlen mode and deployed modules: plan, run. Returns ABI arrays (numpy,
    or DeviceTensors for device-resident inputs)."""
    plan: Plan = build_plan(seqs, p.mask, tiles, out_rows_shape, lse_rows_shape, units_budget(p.hq, tiles, family),
                            state_tiles(p.hq, p.dv, tiles, family), split_unmasked=family == "cpu")
    if plan.n_tiles == 0 or 0 in out_shape:
        return _empty_result(p, out_shape, lse_shape)
    out, lse = get_module().run(p.q.array, p.k.array, p.v.array, p.q.dtype, p.scale, p.hk, plan,
                                keep_on_device=p.q.on_device)
    return out.reshape(out_shape), lse.reshape(lse_shape)


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


def rows_desc(p: BatchProblem) -> np.ndarray:
    """``rows``' per-batch descriptor: (qlen, klen, y, x) with CK's coordinates for the batch's
    own lengths (``rows.ROWS_DESC_COLUMNS``)."""
    return frames.descriptors(p.mask, p.q_lens, p.k_lens)


def dense_kind(p: BatchProblem, dense: dict | None) -> tuple[str, int | None] | None:
    """Whether a batch-mode problem can take a module's one-call dense path: ``("dense", None)``
    (every row sees every key), ``("causal", None)`` (row i sees keys j <= i, Sq == Sk),
    ``("window", W)`` (keys i - W <= j <= i, Sq == Sk: CK's ``b:W,0``), or None (the plan).
    Needs full lengths (no cu_seqlen padding) that the module's entry points take
    (``runtime.dense_entry``: multiples of its alignment, for causal of ``align * causal_blocks``
    or one of its compiled-in ``seqlens``, for a window a compiled-in length whose block holds W)."""
    if not dense or p.sq == 0 or p.sk == 0:
        return None
    if (p.q_lens != p.sq).any() or (p.k_lens != p.sk).any():
        return None
    y, x = p.mask.coords(p.sq, p.sk)
    window = None
    if y >= p.sq and x >= p.sk:
        kind = "dense"
    elif x == 1 and y >= p.sq:
        kind = "causal"
    elif x == 1 and p.sq == p.sk and y >= 1:
        kind, window = "window", y - 1
    else:
        return None
    ok = dense_entry(dense, p.sq, p.sk, kind == "causal", True, p.batch, p.hk, window)
    return (kind, window) if ok else None


def route(p: BatchProblem, module, with_lse: bool = True) -> Route:
    """The path a batch-mode problem takes on ``module`` (a loaded module, or None when the
    problem is empty and nothing is called), and why. A compiled-in or aligned one-call entry
    point that serves the problem (``dense_kind``), except the generic two-block ``causal`` where
    the module has ``fwd``; else ``rows`` for short queries on a CPU module (``rows_fit``, cu_seqlen
    padding included); else, every batch at the full lengths, ``units`` (CPU modules) or ``fwd``
    wherever the module has them; else the tile plan."""
    if module is None:
        return Route("plan", "empty problem: no entry point is called")
    padded = bool((p.q_lens != p.sq).any() or (p.k_lens != p.sk).any())
    kind = None if padded else dense_kind(p, module.dense)
    if kind is None and rows_fit(p, module):
        entry = "rows_kpad" if (p.k_lens != p.sk).any() else "rows"
        return Route("rows", f"short queries (Sq={p.sq}, {p.batch * p.hq * p.sq * p.sk} scores): whole key rows, "
                             "each batch's own lengths and mask", entry)
    if padded and has_ragged(module, p.layout):
        return Route("ragged", "cu_seqlen padding: one padded frame, each batch its own lengths and mask", "fwd_ragged")
    if padded and p.layout == "bshd" and not p.q.on_device and module.has("units_varlen"):
        return Route("units_varlen", "cu_seqlen padding: each batch entry a sequence of the tokens, the tiles of "
                                     "all of them in one call", "units_varlen")
    if padded:
        return Route("plan", "cu_seqlen padding: the tile plan reads each batch's own lengths")
    entry = None if kind is None else module.dense_entry(p.sq, p.sk, kind[0] == "causal", with_lse, p.batch, p.hk,
                                                         kind[1])
    if kind is None and module.has("units"):
        return Route("units", "no one-call entry point takes these lengths and mask: the units of the tile "
                              "plan in one call, looped inside the module", "units")
    if module.has_fwd and (kind is None or entry == "causal"):
        why = "no one-call entry point takes these lengths and mask" if kind is None else \
            "fwd replaces the generic two-block causal entry point"
        return Route("fwd", why, "fwd")
    if kind is not None:
        return Route(kind[0], f"{entry} takes Sq={p.sq}, Sk={p.sk} with this mask", entry, kind[1])
    return Route("plan", "the module has no fwd, and no one-call entry point takes these lengths and mask")


def uses_fwd(p: BatchProblem, module) -> bool:
    """Whether a batch-mode problem runs through the module's ``fwd`` (:func:`route`)."""
    return module is not None and p.sq > 0 and p.sk > 0 and route(p, module).path == "fwd"


def _returned(p: BatchProblem, out, lse, return_lse: bool):
    """``out`` (and ``lse``) in the caller's array type."""
    out = _wrap(out, p.q, p.q.dtype)
    return (out, _wrap(lse, p.q, "f32")) if return_lse else out


def run_batch(p: BatchProblem, return_lse: bool, tiles, get_module, family: str):
    """A checked batch-mode problem on the module ``get_module()`` gives, by :func:`route`."""
    out_shape = (p.batch, p.hq, p.sq, p.dv) if p.layout == "bhsd" else (p.batch, p.sq, p.hq, p.dv)
    module = get_module() if p.sq and p.sk and p.batch else None
    r = route(p, module, return_lse)
    if r.path == "units_varlen":
        out, lse = _padded_batch_units(p, module, tiles.m0)
    elif r.path != "plan":
        out, lse = _runner(p, r, module, return_lse, p.q.on_device)(p.q.array, p.k.array, p.v.array)
    else:
        seqs = Sequences.batch(p.q_lens, p.k_lens)
        out, lse = _execute(p, seqs, out_shape, (p.batch, p.hq, p.sq), (p.batch, p.sq), (p.batch, p.sq), tiles,
                            get_module, family)
    return _returned(p, out, lse, return_lse)


def run_varlen(p: BatchProblem, starts, return_lse: bool, tiles, get_module, family: str, memo=None):
    """A checked group-mode problem (``check_varlen``'s two results) on a module, shared by
    ``fmha_fwd_varlen`` and deployed modules: one ``fwd_ragged`` call where the module has it
    (``bshd``); on a CPU module with host inputs, sequences of short queries in ``rows`` calls
    (:func:`short_sequences`, each call a batch of them padded to its longest), the others in one
    ``units_varlen`` call (CPU modules built before 2026-12-04 evening: the tile plan). ``memo``: given the replay of a one-call path (``prepared.PreparedCalls.memo``;
    the caller's tensors in, its result out), where there is one."""
    q_start, q_len, k_start, k_len, lse_start, total_q = starts
    module = get_module() if p.sq and p.sk else None
    if has_ragged(module, "bshd"):
        return _frame_path(p, starts, module, None, return_lse, memo)
    if p.q.on_device:
        module = None
    short = short_sequences(p, q_len, k_len) if getattr(module, "has_rows", False) else []
    long = np.ones(len(q_len), bool)
    for group in short:
        long[group] = False
    if module is not None and module.has("units_varlen"):  # the long sequences in one call
        out, lse = _units_varlen(p, module, np.flatnonzero(long & (q_len > 0)), starts, tiles.m0)
        for group in short:
            _rows_group(p, module, group, starts, out, lse)
        return _returned(p, out, lse, return_lse)
    seqs = Sequences(np.zeros(int(long.sum()), np.int64), q_start[long], q_len[long], k_start[long], k_len[long],
                     lse_start[long])
    out, lse = _execute(p, seqs, (p.sq, p.hq, p.dv), (p.hq, total_q), (1, p.sq), (1, total_q), tiles, get_module, family)
    for group in short:
        _rows_group(p, module, group, starts, out, lse)
    return _returned(p, out, lse, return_lse)


def run_paged(q, cache: PagedCache, seqstart_q, seqstart_padded_q, *, mask, scale, return_lse: bool, modules, memo=None):
    """Group mode over a paged cache (a checked :class:`paged.PagedCache`); ``modules(p)`` gives
    (tiles, module getter, family) for the problem. A module with ragged frames gathers each
    sequence's keys from its pages on the device; a CPU module with ``rows_packed_pages`` reads the
    pages in place when every sequence is short (:func:`_paged_groups`); elsewhere the keys are
    gathered on the host into packed K/V for :func:`run_varlen`. ``memo`` as there."""
    batch = len(cache.lens)
    p, starts = check_varlen(q, cache.flat("k"), cache.flat("v"), seqstart_q, np.zeros(batch + 1, np.int64),
                             seqlen_k=None, seqstart_padded_q=seqstart_padded_q, seqstart_padded_k=None, mask=mask,
                             scale=scale)
    tiles, get_module, family = modules(p)
    if cache.on_device and family == "cpu":  # CPU modules have no frames: refused before compiling
        raise TypeError("k_cache: CPU modules read a paged cache from host arrays (torch CPU tensors or numpy); "
                        "got a DeviceTensor")
    module = get_module() if p.sq and p.sk else None
    starts = (*starts[:3], cache.lens, *starts[4:])
    if has_ragged(module, "bshd"):
        pages = (frames.paged_bases(cache.block_table, cache.page_size, cache.lens), cache.page_size)
        return _frame_path(p, starts, module, pages, return_lse, memo)
    groups = _paged_groups(p, starts, module)
    if groups is not None:
        out, lse = _empty_result(p, (p.sq, p.hq, p.dv), (p.hq, starts[-1]))
        for group in groups:
            _rows_group(p, module, group, starts, out, lse, cache)
        return _returned(p, out, lse, return_lse)
    k, v, seqstart_k = cache.packed()
    p, starts = check_varlen(q, k, v, seqstart_q, seqstart_k, seqlen_k=None, seqstart_padded_q=seqstart_padded_q,
                             seqstart_padded_k=None, mask=mask, scale=scale)
    return run_varlen(p, starts, return_lse, *modules(p))


def _frame_path(p: BatchProblem, starts, module, pages, return_lse: bool, memo):
    """Group mode as one frame (:func:`frames.group_frame`; ``pages`` a paged cache's row bases
    and page size): the call's result, ``out [Tq, Hq, Dv]`` (and ``lse [Hq, total]``); its
    replay handed to ``memo`` (DeviceTensor inputs only, a composition with work)."""
    frame = frames.group_frame(p.mask, starts, p.sq, pages)
    shapes = (p.sq, p.hq, p.dv), (p.hq, starts[-1])
    if frame.empty:
        return _returned(p, *_empty_result(p, *shapes), return_lse)
    call = frames.frame_call(module, frame, p.q.array.shape, p.k.array.shape, dtype=p.q.dtype, scale=p.scale)
    if memo is not None and p.q.on_device:
        memo(_replay(call, module, shapes, return_lse))
    out, lse = call.run(module, p.q.array, p.k.array, p.v.array, keep=p.q.on_device)
    return _returned(p, out.reshape(shapes[0]), lse.reshape(shapes[1]), return_lse)


def _replay(call: frames.FrameCall, module, shapes, return_lse: bool):
    """``call`` on the caller's DeviceTensors (group mode's own shapes), results left on the
    device; it holds none of the first call's tensors."""
    def run(q, k, v):
        out, lse = call.run(module, *(_as_tokens(x) for x in (q, k, v)), keep=True)
        out, lse = out.reshape(shapes[0]), lse.reshape(shapes[1])
        return (out, lse) if return_lse else out
    return run


def _as_tokens(x: DeviceTensor) -> DeviceTensor:
    """A group-mode tensor (``[T, H, D]``, or a paged cache ``[pages, page, H, D]``) as the
    ``[1, T, H, D]`` batch its problem reads (``check_varlen``, ``PagedCache.flat``)."""
    *lead, h, d = x.shape
    return x.reshape((1, math.prod(lead), h, d))


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


def _paged_groups(p: BatchProblem, starts, module) -> list[np.ndarray] | None:
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


def _units_varlen(p: BatchProblem, module, seqs: np.ndarray, starts, rows: int):
    """The sequences ``seqs`` of a group-mode problem (with query rows; one without keys gets out 0
    and lse -inf from its tiles) in one ``units_varlen`` call over the span of packed rows and keys
    they occupy, read in place. Returns (out ``[Tq, Hq, Dv]``, lse ``[Hq, total]``) with ``seqs``'
    rows written (the call's own arrays where they are all of the packed rows); where the problem's
    sequences fill the packed rows in order, other sequences' rows are left for the caller to
    write, else they are 0 / -inf."""
    q_start, q_len, k_start, k_len, lse_start, total_q = starts
    if not len(seqs):
        return _empty_result(p, (p.sq, p.hq, p.dv), (p.hq, total_q))
    ends = np.cumsum(q_len)
    packed = p.sq == total_q == int(ends[-1]) and np.array_equal(q_start, ends - q_len) and \
        np.array_equal(lse_start, q_start)  # every packed row is some sequence's, in order
    q_start, q_len, k_start, k_len, lse_start = (x[seqs] for x in starts[:5])
    qa, qb = int(q_start.min()), int((q_start + q_len).max())
    ka, kb = int(k_start.min()), max(int((k_start + k_len).max()), int(k_start.min()) + 1)
    desc = frames.descriptors(p.mask, q_len, k_len)
    table = unit_tiles((q_start - qa, q_len, k_start - ka, k_len), (desc[:, 2], desc[:, 3]), rows=rows,
                       group=p.hq // p.hk, head_rows=qb - qa + rows)
    o, l = module.run_units_varlen(p.q.array[:, qa:qb], p.k.array[:, ka:kb], p.v.array[:, ka:kb], p.q.dtype,
                                   p.scale, table)
    if packed and (qa, qb) == (0, p.sq):
        return o[0], l[0]
    out, lse = _empty_result(p, (p.sq, p.hq, p.dv), (p.hq, total_q))
    if packed:
        out[qa:qb], lse[:, qa:qb] = o[0], l[0]
        return out, lse
    seq, rel = runs(q_len)
    out[q_start[seq] + rel] = o[0, q_start[seq] - qa + rel]
    lse[:, lse_start[seq] + rel] = l[0][:, q_start[seq] - qa + rel]
    return out, lse


def _rows_group(p: BatchProblem, module, group: np.ndarray, starts, out: np.ndarray, lse: np.ndarray,
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
        assert cache is None, "a paged cache's groups are all short (_paged_groups)"
        qi = np.minimum(q_start[:, None] + np.arange(mq), p.sq - 1)
        ki = np.minimum(k_start[:, None] + np.arange(mk), p.sk - 1)
        q, k, v = (np.take(x.array[0], idx, axis=0, out=aligned_empty(idx.shape + x.array.shape[2:], x.array.dtype))
                   for x, idx in ((p.q, qi), (p.k, ki), (p.v, ki)))  # [n, S, H, D], bshd, read in place
        o, l = module.run_rows(q, k, v, p.q.dtype, p.scale, desc, padded_keys=True)
    rows, rel = runs(q_len)
    out[q_start[rows] + rel] = o[rows, rel]
    lse[:, lse_start[rows] + rel] = l[rows, :, rel].T


def _padded_batch_units(p: BatchProblem, module, rows: int):
    """A bshd batch with ``cu_seqlen`` padding in one ``units_varlen`` call: batch entry ``b`` is
    the sequence of tokens ``[b Sq, b Sq + q_len[b])`` (keys ``[b Sk, b Sk + k_len[b])``) of the
    batch viewed as ``[1, B S, H, D]``. Returns (out, lse), rows past ``q_len[b]`` 0 and -inf."""
    b, sq, sk = p.batch, p.sq, p.sk
    desc = frames.descriptors(p.mask, p.q_lens, p.k_lens)
    table = unit_tiles((np.arange(b) * sq, p.q_lens, np.arange(b) * sk, p.k_lens), (desc[:, 2], desc[:, 3]),
                       rows=rows, group=p.hq // p.hk, head_rows=b * sq + rows)
    flat = [x.array.reshape((1, -1) + x.array.shape[2:]) for x in (p.q, p.k, p.v)]
    o, l = module.run_units_varlen(*flat, p.q.dtype, p.scale, table)
    out, lse = o.reshape(b, sq, p.hq, p.dv), l.reshape(p.hq, b, sq).transpose(1, 0, 2)
    unused = np.arange(sq)[None, :] >= np.asarray(p.q_lens)[:, None]  # [B, Sq]
    out[unused] = 0
    return out, np.where(unused[:, None, :], np.float32(-np.inf), lse)


def prepare(p: BatchProblem, return_lse: bool, module):
    """A replay of this call for DeviceTensors of the same shapes, dtypes and device (the memo of
    :class:`PreparedCalls`): the module and its one-call entry point chosen once, nothing left to
    check or plan per call. None where the call takes the tile plan (planned per call)."""
    if not p.q.on_device or module is None or p.sq == 0 or p.sk == 0 or p.batch == 0:
        return None
    r = route(p, module, return_lse)
    if r.path == "plan":
        return None
    call = _runner(p, r, module, return_lse, True)

    def run(q, k, v):
        out, lse = call(q, k, v)
        return (out, lse) if return_lse else out
    return run


def _runner(p: BatchProblem, r: Route, module, return_lse: bool, keep: bool):
    """``(q, k, v) -> (out, lse)`` on the one-call entry point of the route ``r`` (not the plan),
    with everything but the tensors fixed now (results left on the device with ``keep``)."""
    dtype, scale, layout = p.q.dtype, p.scale, p.layout
    if r.path in ("fwd", "units"):
        coords = p.mask.clipped_coords(p.sq, p.sk)
        return lambda q, k, v: module.run_fwd(q, k, v, dtype, scale, coords, keep_on_device=keep, fn=r.entry)
    if r.path == "ragged":
        frame = frames.batch_frame(p.mask, p.q_lens, p.k_lens, p.sq, p.sk)
        if frame.empty:
            lse_shape = (p.batch, p.hq, p.sq)
            out_shape = (p.batch, p.hq, p.sq, p.dv) if layout == "bhsd" else (p.batch, p.sq, p.hq, p.dv)
            return lambda q, k, v: _empty_result(p, out_shape, lse_shape)
        call = frames.frame_call(module, frame, p.q.array.shape, p.k.array.shape, dtype=dtype, scale=scale)
        return lambda q, k, v: call.run(module, q, k, v, keep=keep)
    if r.path == "rows":
        desc, padded = rows_desc(p), r.entry == "rows_kpad"
        return lambda q, k, v: module.run_rows(q, k, v, dtype, scale, desc, padded_keys=padded, keep_on_device=keep)
    return lambda q, k, v: module.run_dense(q, k, v, dtype, scale, layout, r.path == "causal", keep_on_device=keep,
                                            with_lse=return_lse, window=r.window)
