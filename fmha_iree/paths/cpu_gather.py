"""The CPU's last path for a paged cache (``cpu_gather``): the used keys gathered on the host into
packed K / V, then group mode's calls on them (``paths.cpu_group``). Host arrays only."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..problem.operand import as_operand
from .base import Call, Problem, Refused
from .capabilities import Capabilities
from .cpu_group import CPU_GROUP
from .cpu_short import host_reasons

__all__ = ["CPU_GATHER"]


@dataclasses.dataclass(frozen=True)
class _GatherCall(Call):
    """The used keys gathered on the host into packed K / V, then group mode's call on them."""

    replayable = False

    prob: Problem
    inner: object  # the group-mode problem's call
    entry: str | None = None
    note: str = ""

    def run(self, module, q, k, v, *, keep: bool):
        inner = self.inner
        return inner.run(module, inner.prob.p.q.array, inner.prob.p.k.array, inner.prob.p.v.array, keep=keep)


class _CpuGather:
    name = "cpu_gather"
    modes = ("paged",)

    def plan(self, prob: Problem, caps: Capabilities):
        found = host_reasons(prob, caps, "waves_varlen")
        if found:
            return Refused(tuple(found))
        p, cache = prob.p, prob.cache
        k, v, seqstart_k = cache.packed()
        k, v = (as_operand(x, name) for x, name in ((k, "k_cache"), (v, "v_cache")))
        k, v = (dataclasses.replace(x, array=x.array.reshape((1,) + x.array.shape)) for x in (k, v))
        lens = np.asarray(cache.lens, np.int64)
        gp = dataclasses.replace(p, k=k, v=v, sk=int(seqstart_k[-1]), k_lens=lens)
        starts = (prob.starts[0], prob.starts[1], seqstart_k[:-1], lens, *prob.starts[4:])
        inner = CPU_GROUP.plan(Problem("group", gp, prob.with_lse, starts), caps)
        if isinstance(inner, Refused):
            return inner
        return _GatherCall(prob, inner, note="the used keys gathered on the host, then " + inner.note)



CPU_GATHER = _CpuGather()
