"""The general batch path: any lengths and any CK mask in one call, every batch entry at the
tensors' full lengths (no cu_seqlen padding). ``fwd`` on the GPU formulation (``kernels.general``:
the attention loops with the mask's banded bounds), ``units`` on the CPU (the tile plan's units
looped inside the module, ``mlir_templates.unit_loop``). Both take CK's (y, x) as scalars.
"""

from __future__ import annotations

import dataclasses

from .base import Call, shaped, Problem, Refused
from .capabilities import Capabilities

__all__ = ["FWD", "UNITS"]


@dataclasses.dataclass(frozen=True)
class CoordsCall(Call):
    """One call of ``fwd`` / ``units``: the scale and CK's clipped (y, x) as scalars."""

    entry: str
    dtype: str
    scalars: tuple
    shapes: tuple
    note: str = ""

    def run(self, module, q, k, v, *, keep: bool):
        d = self.dtype
        out, lse = module.call(self.entry, [(q, d), (k, d), (v, d)], scalars=self.scalars, results=[d, "f32"],
                               keep_on_device=keep)
        return shaped(out, self.shapes[0]), shaped(lse, self.shapes[1])


class _OneCall:
    modes = ("batch",)

    def __init__(self, name: str, formulation: str, note: str):
        self.name, self._formulation, self._note = name, formulation, note

    def plan(self, prob: Problem, caps: Capabilities):
        found = []
        if not caps.has(self.name):
            found.append(caps.missing(self.name) + f" ({self._formulation} modules have it)")
        if prob.mode != "batch":
            found.append("group mode and paged caches run elsewhere")
        elif prob.padded:
            found.append("cu_seqlen padding: every batch entry must use the tensors' full lengths")
        if found:
            return Refused(tuple(found))
        p = prob.p
        y, x = p.mask.clipped_coords(p.sq, p.sk)
        return CoordsCall(self.name, p.q.dtype, (float(p.scale), int(y), int(x)), (prob.out_shape, prob.lse_shape),
                          self._note)


FWD = _OneCall("fwd", "GPU", "any lengths and mask in one call")
UNITS = _OneCall("units", "CPU", "the tile plan's units in one call, looped inside the module")
