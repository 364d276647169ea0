"""From a checked call to its result: the problem as the paths see it (``base.Problem``), the route
(``select``), the call on the loaded module, and the result in the caller's array type. Shared by
the API (``fmha_iree.api``) and deployed modules (``fmha_iree.deploy``).

``get`` below is how the caller's module is reached: ``() -> Loaded``, called only when there is
something to compute (an empty problem loads nothing).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..runtime.device import DeviceTensor
from ..problem.paged import PagedCache
from ..runtime.module import FmhaModule
from ..problem.operand import Operand
from ..problem.spec import BatchProblem, check_varlen
from .base import Problem
from .capabilities import Capabilities
from .select import Route, select

__all__ = ["Loaded", "batch_route", "run_batch", "prepare_batch", "group_route", "run_group", "paged_problem",
           "problem_route", "run_paged"]


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A module on a device and its capabilities."""

    module: FmhaModule
    caps: Capabilities


def _route(prob: Problem, get) -> tuple[Route, Loaded | None]:
    loaded = None if prob.empty else get()
    return select(prob, None if loaded is None else loaded.caps), loaded


def _wrap(array, like: Operand, dtype: str):
    """``array`` in the caller's array type (torch, numpy, or a DeviceTensor left on the device)."""
    if like.on_device or not like.is_torch:
        return array
    import torch

    t = torch.from_numpy(np.ascontiguousarray(array))
    return t.view(torch.bfloat16) if dtype == "bf16" else t


def _run(prob: Problem, r: Route, loaded: Loaded | None, memo=None):
    """Run the route's call on the problem's tensors; its replay handed to ``memo`` where it has
    one (DeviceTensor inputs, a call that keeps nothing of this one's)."""
    p = prob.p
    module = None if loaded is None else loaded.module
    if memo is not None and p.q.on_device and r.call.replayable:
        memo(_replay(prob, r, module))
    out, lse = r.call.run(module, p.q.array, p.k.array, p.v.array, keep=p.q.on_device)
    out = _wrap(out, p.q, p.q.dtype)
    return (out, _wrap(lse, p.q, "f32")) if prob.with_lse else out


def _replay(prob: Problem, r: Route, module):
    """``r``'s call on the caller's DeviceTensors (group mode's ``[T, H, D]`` and a paged cache's
    ``[pages, page, H, D]`` as the ``[1, rows, H, D]`` its problem reads), results on the device."""
    call, tokens = r.call, prob.mode != "batch"

    def run(q, k, v):
        if tokens:
            q, k, v = (_as_tokens(x) for x in (q, k, v))
        out, lse = call.run(module, q, k, v, keep=True)
        return (out, lse) if prob.with_lse else out
    return run


def _as_tokens(x: DeviceTensor) -> DeviceTensor:
    *lead, h, d = x.shape
    return x.reshape((1, math.prod(lead), h, d))


def batch_route(p: BatchProblem, with_lse: bool, get) -> Route:
    """The route of a checked batch-mode problem, without running it."""
    return _route(Problem("batch", p, with_lse), get)[0]


def run_batch(p: BatchProblem, with_lse: bool, get):
    """A checked batch-mode problem's result."""
    prob = Problem("batch", p, with_lse)
    return _run(prob, *_route(prob, get))


def prepare_batch(p: BatchProblem, with_lse: bool, get):
    """A replay of this call for DeviceTensors of the same shapes, dtypes and device
    (``prepared.PreparedCalls``), or None where its path is planned per call."""
    prob = Problem("batch", p, with_lse)
    if not p.q.on_device or prob.empty:
        return None
    r, loaded = _route(prob, get)
    return _replay(prob, r, loaded.module) if r.call.replayable else None


def group_route(p: BatchProblem, starts, with_lse: bool, get) -> Route:
    """The route of a checked group-mode problem (``check_varlen``'s two results)."""
    return _route(Problem("group", p, with_lse, starts), get)[0]


def run_group(p: BatchProblem, starts, with_lse: bool, get, memo=None):
    """A checked group-mode problem's result; ``memo`` as ``prepared.PreparedCalls.memo`` gives."""
    prob = Problem("group", p, with_lse, starts)
    return _run(prob, *_route(prob, get), memo)


def paged_problem(q, cache: PagedCache, seqstart_q, seqstart_padded_q, *, mask, scale, with_lse: bool,
                  softcap=None, alibi_slopes=None, bias=None) -> Problem:
    """A checked group-mode call over a paged cache (a checked ``paged.PagedCache``) as a problem:
    queries as group mode's, the cache read as ``[1, pages * page, Hk, D]`` rows, each sequence's
    keys the cache's ``lens``."""
    batch = len(cache.lens)
    p, starts = check_varlen(q, cache.flat("k"), cache.flat("v"), seqstart_q, np.zeros(batch + 1, np.int64),
                             seqlen_k=None, seqstart_padded_q=seqstart_padded_q, seqstart_padded_k=None, mask=mask,
                             scale=scale, softcap=softcap, alibi_slopes=alibi_slopes, bias=bias,
                             k_len_override=np.asarray(cache.lens, np.int64))
    return Problem("paged", p, with_lse, (*starts[:3], np.asarray(cache.lens, np.int64), *starts[4:]), cache)


def problem_route(prob: Problem, get) -> Route:
    """The route of a problem (``paged_problem``'s, say), without running it."""
    return _route(prob, get)[0]


def run_paged(prob: Problem, get, memo=None):
    """A paged problem's result (``paged_problem``)."""
    return _run(prob, *_route(prob, get), memo)
