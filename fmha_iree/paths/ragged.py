"""The frame path: ``fwd_ragged`` (``kernels.ragged``), every sequence of a problem in one padded
frame (``paths.frame``): a batch with cu_seqlen padding, group mode, a paged cache (its keys
gathered from their pages on the device).

``fwd_ragged`` runs every sequence with its own lengths and mask (``kernels.bounds``: the interior
shared by all, edges masked per sequence), each group of rows over the entries that have rows in
it (the frame ordered longest first, ``Frame.by_length`` / ``Frame.prefix``). It serves what the
tiles refuse: masks whose rows do not all see from key 0 in group mode, decode-shaped problems
whose sequences overflow the pieces' slots.
"""

from __future__ import annotations

import numpy as np

from .base import Problem, Refused
from .capabilities import Capabilities
from .frame import TableCall, problem_frame

__all__ = ["RAGGED"]


class _Ragged:
    name = "ragged"
    modes = ("batch", "group", "paged")

    def plan(self, prob: Problem, caps: Capabilities):
        reasons = []
        if not caps.has("fwd_ragged"):
            reasons.append(caps.missing("fwd_ragged") + " (GPU modules have it)")
        elif caps.layout != prob.p.layout:
            reasons.append(f"the module's fwd_ragged reads {caps.layout} tensors; these are {prob.p.layout}")
        if prob.mode == "batch" and not prob.padded:
            reasons.append("a batch without cu_seqlen padding: fwd serves it in one call")
        if reasons:
            return Refused(tuple(reasons))
        frame = problem_frame(prob).by_length()  # a group of rows computes only the entries with rows in it
        idx, sizes = frame.table(np.zeros(1, np.int32))
        scalars = (float(prob.p.scale), *sizes, *frame.coords(), *frame.prefix())
        return TableCall("fwd_ragged", idx, scalars, prob.p.q.dtype, (prob.out_shape, prob.lse_shape),
                         note="one padded frame, each sequence its own lengths and mask")


RAGGED = _Ragged()
