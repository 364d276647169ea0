"""The tile plan (``plan.build_plan``): the problem's units of query rows x key chunks, run from
the host as ``init``, a ``step`` per wave of units (``step_open`` for unmasked ones where the
module has it) and ``finalize``. Every module has it; it is the path of last resort, for problems
no one-call path takes (a module without ``fwd`` or ``units``; the CPU's cu_seqlen padding past
``rows``; group mode on DeviceTensors on a CPU module).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..runtime.device import DeviceTensor
from ..problem.plan import Block, Plan, Sequences, build_plan, state_tiles, units_budget
from ..runtime.module import Bound, Const, Upload
from .base import Call, shaped, EmptyCall, Problem, Refused
from .capabilities import Capabilities

__all__ = ["PLAN"]


@dataclasses.dataclass(frozen=True)
class PlanCall(Call):
    """A plan's calls; ``hk`` the KV heads (``init``'s state size)."""

    replayable = False

    plan: Plan
    dtype: str
    scale: float
    hk: int
    open_fn: str
    shapes: tuple
    entry: str | None = None
    note: str = ""

    def run(self, module, q, k, v, *, keep: bool):
        plan, d = self.plan, self.dtype
        with module.lock:
            qkv = [Bound(*module.arg(x, d)) for x in (q, k, v)] if plan.n_calls else []
            sd = Const(np.array([self.scale], np.float32), "f32")
            states = [self._block(module, qkv, sd, blk) for blk in plan.blocks]
            if len(states) == 1:
                (acc, m, l), fence = states[0]
                state = [Bound(acc, fence), Bound(m, fence), Bound(l, fence)]
            else:  # several state blocks (the CPU's, plan.state_tiles): joined on the host
                parts = [[DeviceTensor.from_result(x, "f32", module.device_uri, fence).to_numpy() for x in st]
                         for st, fence in states]
                state = [Bound(DeviceTensor.from_host(np.concatenate(xs), "f32", module.device_uri).buffer_view())
                         for xs in zip(*parts)]
            (out, lse), fence = module.invoke("finalize", state + [Upload(plan.out_map), Upload(plan.lse_map)], 2)
            out, lse = module.result(out, fence, d, keep), module.result(lse, fence, "f32", keep)
        return shaped(out, self.shapes[0]), shaped(lse, self.shapes[1])

    def _block(self, module, qkv: list, sd, blk: Block):
        """One state block: ``init`` and its ``step`` calls. Returns ((acc, m, l), fence)."""
        (acc, m, l), fence = module.invoke("init", [Upload(np.zeros((blk.n_tiles, self.hk), np.int32))], 3)
        for desc, unmasked in zip(blk.calls, blk.unmasked):
            fn = self.open_fn if unmasked else "step"
            state = [Bound(acc, fence), Bound(m, fence), Bound(l, fence)]
            (acc, m, l), fence = module.invoke(fn, qkv + [sd, *state, Upload(desc)], 3)
        return (acc, m, l), fence


class _Plan:
    name = "plan"
    modes = ("batch", "group")

    def plan(self, prob: Problem, caps: Capabilities):
        if not caps.has("init", "step", "finalize"):
            return Refused((caps.missing("init", "step", "finalize"),))
        p, tiles, family = prob.p, caps.tiles, caps.family
        if prob.mode == "batch":
            seqs = Sequences.batch(p.q_lens, p.k_lens)
            rows = ((p.batch, p.sq), (p.batch, p.sq))
        else:
            q_start, q_len, k_start, k_len, lse_start, total_q = prob.starts
            seqs = Sequences(np.zeros(len(q_len), np.int64), q_start, q_len, k_start, k_len, lse_start)
            rows = ((1, p.sq), (1, total_q))
        plan = build_plan(seqs, p.mask, tiles, rows[0], rows[1], units_budget(p.hq, tiles, family),
                          state_tiles(p.hq, p.dv, tiles, family), split_unmasked=family == "cpu")
        if plan.n_tiles == 0:
            return EmptyCall(prob, note="no unit of the plan sees a key")
        open_fn = "step_open" if caps.has("step_open") else "step"
        return PlanCall(plan, p.q.dtype, float(p.scale), p.hk, open_fn, (prob.out_shape, prob.lse_shape),
                        note="the tile plan's units from the host")


PLAN = _Plan()
