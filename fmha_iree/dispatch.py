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

from . import frames, key_tiles
from .frames import has_ragged
from .device import DeviceTensor
from .cpu_calls import (WAVE_MAX_ROWS, as_group_mode, empty_result, batch_as_group, paged_groups, rows_desc,
                        rows_fit, rows_group, short_sequences, units_varlen_call, varlen_calls)
from .plan import Plan, Sequences, build_plan, state_tiles, units_budget
from .entries import dense_entry
from .tiles import varlen_rows
from .paged import PagedCache
from .spec import BatchProblem, Operand, check_varlen

__all__ = ["Route", "route", "dense_kind", "uses_fwd", "run_batch", "run_varlen", "run_paged", "prepare", "has_ragged"]


@dataclasses.dataclass(frozen=True)
class Route:
    """The path a batch-mode call takes: ``path`` is ``"fwd"``, ``"units"``, ``"varlen"``, ``"ragged"``, ``"rows"``,
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


def _execute(p: BatchProblem, seqs: Sequences, out_shape, lse_shape, out_rows_shape, lse_rows_shape, tiles, get_module,
             family: str):
    """Shared by batch and varlen mode and deployed modules: plan, run. Returns ABI arrays (numpy,
    or DeviceTensors for device-resident inputs)."""
    plan: Plan = build_plan(seqs, p.mask, tiles, out_rows_shape, lse_rows_shape, units_budget(p.hq, tiles, family),
                            state_tiles(p.hq, p.dv, tiles, family), split_unmasked=family == "cpu")
    if plan.n_tiles == 0 or 0 in out_shape:
        return empty_result(p, out_shape, lse_shape)
    out, lse = get_module().run(p.q.array, p.k.array, p.v.array, p.q.dtype, p.scale, p.hk, plan,
                                keep_on_device=p.q.on_device)
    return out.reshape(out_shape), lse.reshape(lse_shape)


def dense_kind(p: BatchProblem, dense: dict | None) -> tuple[str, int | None] | None:
    """Whether a batch-mode problem can take a module's one-call dense path: ``("dense", None)``
    (every row sees every key), ``("causal", None)`` (row i sees keys j <= i, Sq == Sk),
    ``("window", W)`` (keys i - W <= j <= i, Sq == Sk: CK's ``b:W,0``), or None (the plan).
    Needs full lengths (no cu_seqlen padding) that the module's entry points take
    (``entries.dense_entry``: multiples of its alignment, for causal of ``align * causal_blocks``
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
    the module has ``fwd``; else on a CPU module a bshd batch of middling lengths as group mode
    (``cpu_calls.as_group_mode``), ``rows`` for short queries (``rows_fit``, cu_seqlen padding
    included); else ``fwd_tiles`` (GPU modules: masks whose rows see from key 0, prefill-shaped,
    with cu_seqlen padding or square and causal from 2048 rows, ``_takes_tiles``); else a bshd batch with cu_seqlen padding as
    group mode; else, every batch at the full lengths, ``units`` (CPU modules) or ``fwd`` wherever
    the module has them; else the tile plan."""
    if module is None:
        return Route("plan", "empty problem: no entry point is called")
    padded = bool((p.q_lens != p.sq).any() or (p.k_lens != p.sk).any())
    kind = None if padded else dense_kind(p, module.dense)
    if kind is None and as_group_mode(p, module):
        return Route("varlen", f"{p.layout} batch of Sq={p.sq} against Sk={p.sk}: each batch entry a sequence of "
                               "tokens, run as group mode (cpu_calls.batch_as_group)", _group_entry(p))
    if kind is None and rows_fit(p, module):
        entry = "rows_kpad" if (p.k_lens != p.sk).any() else "rows"
        return Route("rows", f"short queries (Sq={p.sq}, {p.batch * p.hq * p.sq * p.sk} scores): whole key rows, "
                             "each batch's own lengths and mask", entry)
    entry = None if kind is None else module.dense_entry(p.sq, p.sk, kind[0] == "causal", with_lse, p.batch, p.hk,
                                                         kind[1])
    # the generic two-block causal entry is replaced by fwd_tiles / fwd where the module has them
    generic = kind is None or entry == "causal"
    if generic and _takes_tiles(p, module):
        return Route("tiles", "each tile of query rows over its own keys, every batch entry its own lengths "
                              "(kernels.tiles)", "fwd_tiles")
    if padded and has_ragged(module, p.layout):
        return Route("ragged", "cu_seqlen padding: one padded frame, each batch its own lengths and mask", "fwd_ragged")
    if padded and not p.q.on_device and (p.layout == "bshd" and module.has("units_varlen") or module.has(
            "waves_varlen") and p.sq <= WAVE_MAX_ROWS):
        return Route("varlen", "cu_seqlen padding: each batch entry a sequence of tokens, run as group mode "
                               "(cpu_calls.batch_as_group)", _group_entry(p) if module.has("waves_varlen") else "units_varlen")
    if padded:
        return Route("plan", "cu_seqlen padding: the tile plan reads each batch's own lengths")
    if kind is None and module.has("units"):
        return Route("units", "no one-call entry point takes these lengths and mask: the units of the tile "
                              "plan in one call, looped inside the module", "units")
    if module.has_fwd and generic:
        why = "no one-call entry point takes these lengths and mask" if kind is None else \
            "fwd replaces the generic two-block causal entry point"
        return Route("fwd", why, "fwd")
    if kind is not None:
        return Route(kind[0], f"{entry} takes Sq={p.sq}, Sk={p.sk} with this mask", entry, kind[1])
    return Route("plan", "the module has no fwd, and no one-call entry point takes these lengths and mask")


def _takes_tiles(p: BatchProblem, module) -> bool:
    """Whether ``fwd_tiles`` serves a batch-mode problem no compiled-in entry point takes: the
    module has it, ``key_tiles.refusal`` gives no reason, and it was measured faster than the
    other paths for such a batch (``key_tiles.batch_pays``)."""
    info = key_tiles.module_tiles(module)
    if info is None or not key_tiles.batch_pays(p):
        return False
    starts, _ = key_tiles.batch_starts(p.q_lens, p.k_lens, p.sq)
    return key_tiles.refusal(info, starts, p.sq, p.sk) is None


def _group_entry(p: BatchProblem) -> str:
    """The entry point group mode gives a batch's entries (``cpu_calls.varlen_calls``)."""
    return "waves_varlen" if int(np.max(p.q_lens)) <= WAVE_MAX_ROWS else "units_varlen"


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
    if r.path == "varlen":
        out, lse = batch_as_group(p, module, varlen_rows(tiles))
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
    (``bshd``); on a CPU module with host inputs, ``cpu_calls.varlen_calls`` (``rows_packed``
    groups, one ``waves_varlen`` call, one ``units_varlen`` call); CPU modules built before
    2026-12-05: sequences of short queries in ``rows`` calls (:func:`short_sequences`, each call a
    batch of them padded to its longest), the others in one ``units_varlen`` call (before
    2026-12-04 evening: the tile plan). ``memo``: given the replay of a one-call path (``prepared.PreparedCalls.memo``;
    the caller's tensors in, its result out), where there is one."""
    q_start, q_len, k_start, k_len, lse_start, total_q = starts
    module = get_module() if p.sq and p.sk else None
    if has_ragged(module, "bshd"):
        return _frame_path(p, starts, module, None, return_lse, memo)
    if p.q.on_device:
        module = None
    if module is not None and module.has("waves_varlen"):
        return _returned(p, *varlen_calls(p, module, starts, varlen_rows(tiles)), return_lse)
    short = short_sequences(p, q_len, k_len) if getattr(module, "has_rows", False) else []
    long = np.ones(len(q_len), bool)
    for group in short:
        long[group] = False
    if module is not None and module.has("units_varlen"):  # the long sequences in one call
        out, lse = units_varlen_call(p, module, np.flatnonzero(long & (q_len > 0)), starts, varlen_rows(tiles))
        for group in short:
            rows_group(p, module, group, starts, out, lse)
        return _returned(p, out, lse, return_lse)
    seqs = Sequences(np.zeros(int(long.sum()), np.int64), q_start[long], q_len[long], k_start[long], k_len[long],
                     lse_start[long])
    out, lse = _execute(p, seqs, (p.sq, p.hq, p.dv), (p.hq, total_q), (1, p.sq), (1, total_q), tiles, get_module, family)
    for group in short:
        rows_group(p, module, group, starts, out, lse)
    return _returned(p, out, lse, return_lse)


def run_paged(q, cache: PagedCache, seqstart_q, seqstart_padded_q, *, mask, scale, return_lse: bool, modules, memo=None):
    """Group mode over a paged cache (a checked :class:`paged.PagedCache`); ``modules(p)`` gives
    (tiles, module getter, family) for the problem. A module with ragged frames gathers each
    sequence's keys from its pages on the device; a CPU module with ``rows_packed_pages`` reads the
    pages in place when every sequence is short (:func:`cpu_calls.paged_groups`); elsewhere the keys are
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
    groups = paged_groups(p, starts, module)
    if groups is not None:
        out, lse = empty_result(p, (p.sq, p.hq, p.dv), (p.hq, starts[-1]))
        for group in groups:
            rows_group(p, module, group, starts, out, lse, cache)
        return _returned(p, out, lse, return_lse)
    k, v, seqstart_k = cache.packed()
    p, starts = check_varlen(q, k, v, seqstart_q, seqstart_k, seqlen_k=None, seqstart_padded_q=seqstart_padded_q,
                             seqstart_padded_k=None, mask=mask, scale=scale)
    return run_varlen(p, starts, return_lse, *modules(p))


def _frame_path(p: BatchProblem, starts, module, pages, return_lse: bool, memo):
    """Group mode as one frame (:func:`frames.group_frame`; ``pages`` a paged cache's row bases
    and page size): the call's result, ``out [Tq, Hq, Dv]`` (and ``lse [Hq, total]``); its
    replay handed to ``memo`` (DeviceTensor inputs only, a composition with work)."""
    shapes = (p.sq, p.hq, p.dv), (p.hq, starts[-1])
    # tiles over their own keys, where the module and the mask allow (a paged cache's used rows
    # gathered first)
    if pages is None:
        call = key_tiles.tiles_call(module, p.mask, starts, p.q.array.shape, p.k.array.shape, dtype=p.q.dtype,
                                    scale=p.scale)
    else:
        call = key_tiles.paged_call(module, p.mask, starts, pages, p.q.array.shape, dtype=p.q.dtype, scale=p.scale)
    if call is None:
        frame = frames.group_frame(p.mask, starts, p.sq, pages)
        if frame.empty:
            return _returned(p, *empty_result(p, *shapes), return_lse)
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
    if r.path == "tiles":
        call = key_tiles.batch_call(module, p, dtype=dtype, scale=scale)
        return lambda q, k, v: call.run(module, q, k, v, keep=keep)
    if r.path == "ragged":
        frame = frames.batch_frame(p.mask, p.q_lens, p.k_lens, p.sq, p.sk)
        if frame.empty:
            lse_shape = (p.batch, p.hq, p.sq)
            out_shape = (p.batch, p.hq, p.sq, p.dv) if layout == "bhsd" else (p.batch, p.sq, p.hq, p.dv)
            return lambda q, k, v: empty_result(p, out_shape, lse_shape)
        call = frames.frame_call(module, frame, p.q.array.shape, p.k.array.shape, dtype=dtype, scale=scale)
        return lambda q, k, v: call.run(module, q, k, v, keep=keep)
    if r.path == "rows":
        desc, padded = rows_desc(p), r.entry == "rows_kpad"
        return lambda q, k, v: module.run_rows(q, k, v, dtype, scale, desc, padded_keys=padded, keep_on_device=keep)
    return lambda q, k, v: module.run_dense(q, k, v, dtype, scale, layout, r.path == "causal", keep_on_device=keep,
                                            with_lse=return_lse, window=r.window)
