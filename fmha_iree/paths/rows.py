"""CPU ``rows`` / ``rows_kpad`` (``rows.Rows``): short queries of a batch, every key row whole (any
lengths and CK mask, cu_seqlen padding too), one call. It holds every score of the call, so it
takes at most ``ROWS_MAX_ROWS`` query rows per KV head and ``ROWS_MAX_SCORES`` scores.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..runtime.module import Const
from .base import Call, shaped, Problem, Refused
from .capabilities import Capabilities
from .frame import descriptors
from .policy import ROWS_MAX_ROWS, ROWS_MAX_SCORES

__all__ = ["ROWS"]


@dataclasses.dataclass(frozen=True)
class RowsCall(Call):
    """One ``rows`` call: each batch entry's (qlen, klen, y, x) as its descriptor
    (``abi.ROWS_DESC_COLUMNS``)."""

    entry: str
    dtype: str
    scale: float
    desc: np.ndarray
    shapes: tuple
    note: str = ""

    def run(self, module, q, k, v, *, keep: bool):
        d = self.dtype
        args = [(q, d), (k, d), (v, d), Const(np.array([self.scale], np.float32), "f32"), Const(self.desc, "i32")]
        out, lse = module.call(self.entry, args, results=[d, "f32"], keep_on_device=keep)
        return shaped(out, self.shapes[0]), shaped(lse, self.shapes[1])


class _Rows:
    name = "rows"
    modes = ("batch",)

    def plan(self, prob: Problem, caps: Capabilities):
        p, found = prob.p, []
        if not caps.has("rows", "rows_kpad"):
            found.append(caps.missing("rows", "rows_kpad") + " (CPU modules have them)")
        if prob.mode != "batch":
            found.append("group mode and paged caches run elsewhere")
        if p.sq * prob.group > ROWS_MAX_ROWS:
            found.append(f"{p.sq * prob.group} query rows per KV head, more than {ROWS_MAX_ROWS} "
                         "(policy.ROWS_MAX_ROWS: longer queries skip masked blocks elsewhere)")
        if p.batch * p.hq * p.sq * p.sk > ROWS_MAX_SCORES:
            found.append(f"more than {ROWS_MAX_SCORES} scores in one call (policy.ROWS_MAX_SCORES)")
        if found:
            return Refused(tuple(found))
        entry = "rows_kpad" if (p.k_lens != p.sk).any() else "rows"
        desc = np.ascontiguousarray(descriptors(p.mask, p.q_lens, p.k_lens), np.int32)
        return RowsCall(entry, p.q.dtype, float(p.scale), desc, (prob.out_shape, prob.lse_shape),
                        f"short queries (Sq={p.sq}): whole key rows, each batch entry its own lengths and mask")


ROWS = _Rows()
