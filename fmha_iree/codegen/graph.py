"""The plan's ABI and its ``init`` / ``finalize`` as torch graphs (``step`` is the MLIR template
``mlir/online_step.mlir.in``, ``mlir_templates.step``; ``step_open``, in CPU modules, the same
without the mask, for units whose rows see every key of their chunk).

Every module, whatever the target, exports the same ABI (``ABI_VERSION``):

``init(carrier[NT, Hk] i32) -> (acc, m, l)``
    A fresh online-softmax state for ``NT`` query tiles: ``acc [NT, Hk, G*R, Dv]`` f32 zeros,
    ``m [NT, Hk, G*R]`` f32 -inf (running max, in log2 units), ``l`` f32 zeros (running sum).
``step(q, k, v, scale[1] f32, acc, m, l, desc[P, 10] i32) -> (acc, m, l)``
    Processes ``P`` work units, each one query tile of ``R`` rows against one chunk of ``C`` keys
    for every KV head, and merges them into the state of their tiles (tiles are distinct within a
    call). ``desc`` columns are ``DESC_COLUMNS``: the tile, the batch slot, the physical start of the
    rows and keys on the sequence axis, their positions inside their sequence, the sequence's
    lengths and CK's mask coordinates (y, x). Row ``i`` sees key ``j`` iff
    ``i < qlen and j < klen and i - y + 1 <= j < i + x`` (``i``, ``j`` sequence-relative).
``finalize(acc, m, l, out_map[Bo, So] i32, lse_map[Bl, Sl] i32) -> (out, lse)``
    ``out`` and ``lse`` rows gathered from state slots ``tile * R + row`` (``-1``: a row no
    sequence owns, which gives 0 / -inf). ``out`` is in the problem's layout and dtype; ``lse`` is
    ``[Bl, Hq, Sl]`` f32, natural log. Rows that saw no key give 0 / -inf, never NaN.

bf16 tensors cross the ABI as int16 bit patterns (numpy has no bfloat16).

The masking is explicit and per unit: the host plan (``plan.py``) only creates units for the key
chunks CK's ``GetTileRangeAlongX`` leaves visible, so no tensor of ``Sq x Sk`` elements exists.
"""

from __future__ import annotations

import threading

import torch

from .rows import export_rows, export_short
from ..problem.spec import KernelSpec
from .torch_abi import LN2, NEG_INF, to_abi

__all__ = ["DESC_COLUMNS", "ABI_VERSION", "export_module", "build_programs"]

from ..problem.abi import ABI_VERSION, PLAN_DESC_COLUMNS as DESC_COLUMNS

class Init(torch.nn.Module):
    def __init__(self, spec: KernelSpec):
        super().__init__()
        self.rows = spec.group * spec.tiles.m0
        self.dv = spec.dv

    def forward(self, carrier):
        nt, hk = carrier.shape
        acc = torch.zeros(nt, hk, self.rows, self.dv, dtype=torch.float32)
        m = torch.full((nt, hk, self.rows), NEG_INF, dtype=torch.float32)
        l = torch.zeros(nt, hk, self.rows, dtype=torch.float32)
        return acc, m, l


class Finalize(torch.nn.Module):
    def __init__(self, spec: KernelSpec):
        super().__init__()
        self.spec = spec

    def forward(self, acc, m, l, out_map, lse_map):
        sp = self.spec
        R, G, Dv = sp.tiles.m0, sp.group, sp.dv
        nt, hk_n = acc.shape[0], acc.shape[1]
        hq_n = hk_n * G
        # State rows are (g, r) per KV head; slots are tile * R + r.
        acc_s = acc.reshape(nt, hk_n, G, R, Dv).permute(0, 3, 1, 2, 4).reshape(nt * R, hq_n, Dv)
        m_s = m.reshape(nt, hk_n, G, R).permute(0, 3, 1, 2).reshape(nt * R, hq_n)
        l_s = l.reshape(nt, hk_n, G, R).permute(0, 3, 1, 2).reshape(nt * R, hq_n)

        bo, so = out_map.shape
        omap = out_map.reshape(-1).to(torch.int64)
        ovalid = omap >= 0
        oidx = torch.clamp(omap, min=0)
        a = torch.index_select(acc_s, 0, oidx)
        den = torch.index_select(l_s, 0, oidx)
        # Rows with no visible key (l == 0) or owned by no sequence are 0; NaN stays NaN.
        keep = torch.logical_and(ovalid[:, None], torch.logical_or(den > 0, torch.isnan(den)))
        den = torch.where(keep, den, torch.ones_like(den))
        out = torch.where(keep[..., None], a / den[..., None], torch.zeros_like(a))
        out = out.reshape(bo, so, hq_n, Dv)
        if sp.layout == "bhsd":
            out = out.permute(0, 2, 1, 3)

        bl, sl = lse_map.shape
        lmap = lse_map.reshape(-1).to(torch.int64)
        lidx = torch.clamp(lmap, min=0)
        mm = torch.index_select(m_s, 0, lidx)
        ll = torch.index_select(l_s, 0, lidx)
        lse = (mm + torch.log2(ll)) * LN2
        lvalid = (lmap >= 0)[:, None]
        lse = torch.where(torch.logical_and(lvalid, ll > 0), lse, torch.full_like(lse, NEG_INF))
        # NaN stays NaN in the rows a sequence owns; rows no sequence owns are -inf even when the
        # slot they were clamped to holds NaN
        lse = torch.where(torch.logical_and(lvalid, torch.isnan(ll)), ll, lse)
        lse = lse.reshape(bl, sl, hq_n).permute(0, 2, 1)
        return to_abi(out, sp.dtype), lse


def _examples(spec: KernelSpec):
    """Example arguments and dynamic dims for torch.export (sizes chosen to be distinct)."""
    from torch.export import Dim

    G, R, Dv = spec.group, spec.tiles.m0, spec.dv
    Hk, NT = 3, 5
    dHk, dNT = Dim("Hk"), Dim("NT")
    acc = torch.zeros(NT, Hk, G * R, Dv)
    m = torch.zeros(NT, Hk, G * R)
    state_dims = {0: dNT, 1: dHk}
    init = dict(args=(torch.zeros(NT, Hk, dtype=torch.int32),), dynamic_shapes={"carrier": {0: dNT, 1: dHk}})
    dBo, dSo, dBl, dSl = (Dim(n) for n in ("Bo", "So", "Bl", "Sl"))
    fin = dict(
        args=(acc, m, m.clone(), torch.zeros(3, 7, dtype=torch.int32), torch.zeros(2, 9, dtype=torch.int32)),
        dynamic_shapes={
            "acc": state_dims, "m": state_dims, "l": state_dims,
            "out_map": {0: dBo, 1: dSo}, "lse_map": {0: dBl, 1: dSl},
        },
    )
    return init, fin


def build_programs(spec: KernelSpec, *, with_rows: bool = True):
    """``init`` and ``finalize`` as an iree-turbine FxProgramsBuilder, with the CPU's whole-key-row
    entry points of ``rows.py`` where ``with_rows`` (the plan's ``step`` is an MLIR template,
    ``mlir_templates.step``)."""
    from iree.turbine import aot

    class Root(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.init_ = Init(spec)
            self.finalize_ = Finalize(spec)

    fxb = aot.FxProgramsBuilder(Root())
    init, fin = _examples(spec)

    @fxb.export_program(name="init", args=init["args"], dynamic_shapes=init["dynamic_shapes"])
    def _init(root, carrier):
        return root.init_(carrier)

    @fxb.export_program(name="finalize", args=fin["args"], dynamic_shapes=fin["dynamic_shapes"])
    def _finalize(root, acc, m, l, out_map, lse_map):
        return root.finalize_(acc, m, l, out_map, lse_map)

    if with_rows:
        export_short(fxb, spec)
        for seqlen in spec.seqlens:
            for causal in (False, True):
                for with_lse in (True, False):
                    export_rows(fxb, spec, seqlen, causal, with_lse)

    return fxb


# torch.export keeps its tracing modes on a process-wide stack: two exports at once in two
# threads corrupt each other ("Trying to pop empty mode stack"), so exports take turns.
_EXPORT_LOCK = threading.Lock()


def export_module(spec: KernelSpec, *, with_rows: bool = True) -> str:
    """MLIR text (torch dialect) of the module for ``spec``, named after its specialization.
    Safe to call from several threads (exports are serialized)."""
    import warnings

    from iree.turbine import aot

    with _EXPORT_LOCK, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        exported = aot.export(build_programs(spec, with_rows=with_rows), module_name=spec.module_name)
    return str(exported.mlir_module)
