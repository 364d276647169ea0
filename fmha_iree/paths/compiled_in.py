"""The one-call entries of fixed or aligned lengths (``mlir_templates``, the CPU's ``rows.RowBlocks``):

- ``compiled_in``: entries fixed to a length compiled in with ``--seqlens`` (Sq == Sk == S, no
  cu_seqlen padding): on GPUs the fused out-only ops (``dense_o_s<S>``, and ``causal_o_s<S>`` up
  to ``source.CAUSAL_MASKED_MAX``); on the CPU row blocks of plain
  matmul / softmax (``dense_s<S>``, ``causal_s<S>`` and their ``_o`` forms), fixed to a batch and
  KV heads where compiled so.
- ``dense``: a GPU module's ``dense``, every row sees every key, lengths multiples of its alignment.

Both take a whole batch in one call of the module's layout (GPU templates read q / k / v as blocks
of ``align`` rows) and a workspace the runtime provides.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..runtime.module import Const
from .base import Call, Problem, Refused, shaped
from .capabilities import Capabilities, DenseCaps

__all__ = ["COMPILED_IN", "DENSE", "mask_kind", "fixed_entry"]


def mask_kind(prob: Problem) -> str | None:
    """The mask as these entries know it: ``"dense"`` (every row sees every key), ``"causal"`` (row
    i sees keys j <= i, Sq == Sk), or None."""
    p = prob.p
    y, x = p.mask.coords(p.sq, p.sk)
    if y >= p.sq and x >= p.sk:
        return "dense"
    if x == 1 and y >= p.sq:
        return "causal"
    return None


def fixed_entry(d: DenseCaps, prob: Problem, kind: str) -> str | None:
    """The compiled-in entry for a batch of Sq == Sk == S with mask ``kind``, or None."""
    p = prob.p
    if p.sq != p.sk or p.sq not in d.seqlens:
        return None
    if any(pinned and have != pinned for pinned, have in ((d.batch, p.batch), (d.kv_heads, p.hk))):
        return None
    s, name = p.sq, kind
    if not d.dynamic:  # the CPU's row blocks
        return f"{name}{'' if prob.with_lse else '_o'}_s{s}"
    if name == "dense":
        return None if prob.with_lse else f"dense_o_s{s}"
    return f"causal_o_s{s}" if not prob.with_lse and s in d.causal_o else None


def _common_reasons(prob: Problem, caps: Capabilities) -> list[str]:
    out = []
    if caps.dense is None:
        out.append("the module has no compiled-in or aligned entries (a CPU module without --seqlens, or a GPU "
                   "lowering IREE picks)")
    if prob.mode != "batch":
        out.append("group mode and paged caches run elsewhere")
    elif prob.padded:
        out.append("cu_seqlen padding: these entries take whole lengths")
    return out


@dataclasses.dataclass(frozen=True)
class DenseCall(Call):
    """One call of a compiled-in or aligned entry on a whole batch."""

    entry: str
    dense: DenseCaps
    layout: str
    dtype: str
    scale: float
    out_only: bool
    shapes: tuple
    note: str = ""

    def _tiled(self, x):
        if not self.dense.tiled:
            return x
        a, (b, s1, s2, d) = self.dense.align, x.shape
        return x.reshape((b, s1, s2 // a, a, d) if self.layout == "bhsd" else (b, s1 // a, a, s2, d))

    def run(self, module, q, k, v, *, keep: bool):
        args = [(self._tiled(x), self.dtype) for x in (q, k, v)] + [Const(np.array([self.scale], np.float32), "f32")]
        res = module.call(self.entry, args, results=[self.dtype] if self.out_only else [self.dtype, "f32"],
                          keep_on_device=keep)
        out = shaped(res[0], self.shapes[0])
        return out, (None if self.out_only else shaped(res[1], self.shapes[1]))


def _call(prob: Problem, caps: Capabilities, entry: str, note: str) -> DenseCall:
    p = prob.p
    return DenseCall(entry, caps.dense, p.layout, p.q.dtype, float(p.scale), "_o_s" in entry,
                     (prob.out_shape, prob.lse_shape), note)


class _CompiledIn:
    name = "compiled_in"
    modes = ("batch",)

    def plan(self, prob: Problem, caps: Capabilities):
        found = _common_reasons(prob, caps)
        if found:
            return Refused(tuple(found))
        kind = mask_kind(prob)
        if kind is None:
            return Refused(("the mask is neither unmasked nor causal",))
        entry = fixed_entry(caps.dense, prob, kind)
        if entry is None:
            have = ", ".join(map(str, caps.dense.seqlens)) or "none"
            return Refused((f"no compiled-in entry takes Sq={prob.p.sq}, Sk={prob.p.sk} with this mask (lengths "
                            f"compiled in: {have})",))
        return _call(prob, caps, entry, f"{entry} takes Sq = Sk = {prob.p.sq} with this mask")


class _Dense:
    name = "dense"
    modes = ("batch",)

    def plan(self, prob: Problem, caps: Capabilities):
        found = _common_reasons(prob, caps)
        if found:
            return Refused(tuple(found))
        d, p = caps.dense, prob.p
        if not d.dynamic or not caps.has("dense"):
            found.append(caps.missing("dense") or "the module's entries are fixed to their lengths")
        if mask_kind(prob) != "dense":
            found.append("masked: dense has every row see every key")
        if p.sq % d.align or p.sk % d.align:
            found.append(f"Sq={p.sq}, Sk={p.sk} are not multiples of the module's alignment {d.align}")
        if found:
            return Refused(tuple(found))
        return _call(prob, caps, "dense", f"unmasked, lengths multiples of {d.align}")


COMPILED_IN = _CompiledIn()
DENSE = _Dense()
