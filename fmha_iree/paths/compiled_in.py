"""The one-call entries of fixed or aligned lengths (``mlir_templates``, the CPU's ``rows.RowBlocks``):

- ``compiled_in``: entries fixed to a length compiled in with ``--seqlens`` (Sq == Sk == S, no
  cu_seqlen padding): on GPUs the causal tree (``causal_s<S>``), the fused out-only ops
  (``dense_o_s<S>``, ``causal_o_s<S>``) and ``window_s<S>``; on the CPU row blocks of plain
  matmul / softmax (``dense_s<S>``, ``causal_s<S>`` and their ``_o`` forms), fixed to a batch and
  KV heads where compiled so.
- ``dense``: a GPU module's ``dense``, every row sees every key, lengths multiples of its alignment.

Both take a whole batch in one call of the module's layout (GPU templates read q / k / v as blocks
of ``align`` rows) and a workspace the runtime provides.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..runtime import Const
from .base import Call, Problem, Refused
from .capabilities import Capabilities, DenseCaps

__all__ = ["COMPILED_IN", "DENSE", "mask_kind", "fixed_entry"]


def mask_kind(prob: Problem) -> tuple[str, int | None] | None:
    """The mask as these entries know it: ``("dense", None)`` (every row sees every key),
    ``("causal", None)`` (row i sees keys j <= i, Sq == Sk), ``("window", W)`` (keys
    i - W <= j <= i, Sq == Sk: CK's ``b:W,0``), or None."""
    p = prob.p
    y, x = p.mask.coords(p.sq, p.sk)
    if y >= p.sq and x >= p.sk:
        return "dense", None
    if x == 1 and y >= p.sq:
        return "causal", None
    if x == 1 and p.sq == p.sk and y >= 1:
        return "window", y - 1
    return None


def fixed_entry(d: DenseCaps, prob: Problem, kind: tuple[str, int | None]) -> str | None:
    """The compiled-in entry for a batch of Sq == Sk == S with mask ``kind``, or None."""
    p = prob.p
    if p.sq != p.sk or p.sq not in d.seqlens:
        return None
    if any(pinned and have != pinned for pinned, have in ((d.batch, p.batch), (d.kv_heads, p.hk))):
        return None
    s, (name, window) = p.sq, kind
    if name == "window":
        c = d.window_block(s)
        return f"window_s{s}" if c is not None and 0 <= window <= c else None
    if not d.dynamic:  # the CPU's row blocks
        return f"{name}{'' if prob.with_lse else '_o'}_s{s}"
    if name == "dense":
        return None if prob.with_lse else f"dense_o_s{s}"
    return f"causal_o_s{s}" if not prob.with_lse and s in d.causal_o else f"causal_s{s}"


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
    window: int | None
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
        if self.window is not None:
            args.append(Const(np.array([self.window], np.int32), "i32"))
        res = module.call(self.entry, args, results=[self.dtype] if self.out_only else [self.dtype, "f32"],
                          keep_on_device=keep)
        out = res[0].reshape(self.shapes[0])
        return out, (None if self.out_only else res[1].reshape(self.shapes[1]))


def _call(prob: Problem, caps: Capabilities, entry: str, window: int | None, note: str) -> DenseCall:
    p = prob.p
    return DenseCall(entry, caps.dense, p.layout, p.q.dtype, float(p.scale), window, "_o_s" in entry,
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
            return Refused(("the mask is none of unmasked, causal or a window b:W,0 with Sq == Sk",))
        entry = fixed_entry(caps.dense, prob, kind)
        if entry is None:
            have = ", ".join(map(str, caps.dense.seqlens)) or "none"
            return Refused((f"no compiled-in entry takes Sq={prob.p.sq}, Sk={prob.p.sk} with this mask (lengths "
                            f"compiled in: {have})",))
        return _call(prob, caps, entry, kind[1], f"{entry} takes Sq = Sk = {prob.p.sq} with this mask")


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
        if mask_kind(prob) != ("dense", None):
            found.append("masked: dense has every row see every key")
        if p.sq % d.align or p.sk % d.align:
            found.append(f"Sq={p.sq}, Sk={p.sk} are not multiples of the module's alignment {d.align}")
        if found:
            return Refused(tuple(found))
        return _call(prob, caps, "dense", None, f"unmasked, lengths multiples of {d.align}")


COMPILED_IN = _CompiledIn()
DENSE = _Dense()
