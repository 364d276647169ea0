"""The attention as torch graphs: the three entry points of a compiled FMHA module.

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
chunks CK's ``GetTileRangeAlongX`` leaves visible, so no tensor of ``Sq x Sk`` elements exists; the
largest intermediate is a unit's ``R x C`` scores per head.
"""

from __future__ import annotations

import threading

import torch

from .rows import export_rows, export_short
from .spec import KernelSpec
from .torch_abi import LN2, LOG2E, NEG_INF, abi_dtype, from_abi, to_abi

__all__ = ["DESC_COLUMNS", "ABI_VERSION", "export_module", "build_programs"]

ABI_VERSION = 1
DESC_COLUMNS = ("tile", "b", "q0", "k0", "qrel0", "krel0", "qlen", "klen", "y", "x")

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


class Step(torch.nn.Module):
    """One wave of work units, as plain batched matmul / softmax math on gathered tiles."""

    def __init__(self, spec: KernelSpec):
        super().__init__()
        self.spec = spec

    def _gather(self, x, b, h, s, heads_axis_first: bool):
        """Rows ``x[b, s, h]`` (bshd) or ``x[b, h, s]`` (bhsd) as one flat index_select."""
        bsz, d1, d2, d = x.shape
        if heads_axis_first:  # bhsd: [B, H, S, D]
            lin = (b * d1 + h) * d2 + s
        else:  # bshd: [B, S, H, D]
            lin = (b * d1 + s) * d2 + h
        shape = lin.shape
        out = torch.index_select(x.reshape(-1, d), 0, lin.reshape(-1))
        return out.reshape(*shape, d)

    def forward(self, q, k, v, scale, acc, m, l, desc):
        sp = self.spec
        R, C, G, Dv = sp.tiles.m0, sp.tiles.kv_chunk, sp.group, sp.dv
        bhsd = sp.layout == "bhsd"
        q, k, v = from_abi(q, sp.dtype), from_abi(k, sp.dtype), from_abi(v, sp.dtype)
        d = desc.to(torch.int64)
        tile, b, q0, k0, qrel0, krel0, qlen, klen, y, x = (d[:, i] for i in range(10))
        sq = q.shape[2] if bhsd else q.shape[1]
        sk = k.shape[2] if bhsd else k.shape[1]
        hk_n = acc.shape[1]
        P = desc.shape[0]

        r = torch.arange(R, dtype=torch.int64)
        c = torch.arange(C, dtype=torch.int64)
        hk = torch.arange(hk_n, dtype=torch.int64)
        g = torch.arange(G, dtype=torch.int64)
        srow = torch.clamp(q0[:, None] + r, 0, sq - 1)  # [P, R]
        skey = torch.clamp(k0[:, None] + c, 0, sk - 1)  # [P, C]

        # Q tile [P, Hk, G, R, Dq]; K / V chunks [P, Hk, C, D].
        qh = hk[:, None] * G + g  # [Hk, G]
        qt = self._gather(q, b[:, None, None, None], qh[None, :, :, None], srow[:, None, None, :], bhsd)
        kt = self._gather(k, b[:, None, None], hk[None, :, None], skey[:, None, :], bhsd)
        vt = self._gather(v, b[:, None, None], hk[None, :, None], skey[:, None, :], bhsd)
        qt = qt.to(torch.float32).reshape(P, hk_n, G * R, -1)
        kt = kt.to(torch.float32)
        # Keys past the sequence's length are padding: keep them out of P @ V (0 * NaN = NaN).
        inside = (krel0[:, None] + c < klen[:, None])[:, None, :, None]  # [P, 1, C, 1]
        vt = torch.where(inside, vt.to(torch.float32), torch.zeros((), dtype=torch.float32))

        # Scores in log2 units, masked by the unit's window.
        s = torch.matmul(qt, kt.transpose(2, 3)) * (scale * LOG2E)  # [P, Hk, G*R, C]
        i = qrel0[:, None] + r  # [P, R]
        j = krel0[:, None] + c  # [P, C]
        lo = torch.clamp(i - y[:, None] + 1, min=0)
        hi = torch.minimum(i + x[:, None], klen[:, None])
        hi = torch.where(i < qlen[:, None], hi, torch.zeros_like(hi))
        vis = torch.logical_and(j[:, None, :] >= lo[:, :, None], j[:, None, :] < hi[:, :, None])  # [P, R, C]
        vis = vis[:, None, None].expand(P, 1, G, R, C).reshape(P, 1, G * R, C)
        s = torch.where(vis, s, NEG_INF)

        # Online-softmax merge with the tiles' previous state.
        slot = tile[:, None] * hk_n + hk  # [P, Hk]
        accf = acc.reshape(-1, G * R, Dv)
        mf = m.reshape(-1, G * R)
        lf = l.reshape(-1, G * R)
        flat = slot.reshape(-1)
        m_old = torch.index_select(mf, 0, flat).reshape(P, hk_n, G * R)
        l_old = torch.index_select(lf, 0, flat).reshape(P, hk_n, G * R)
        a_old = torch.index_select(accf, 0, flat).reshape(P, hk_n, G * R, Dv)
        m_new = torch.maximum(m_old, s.amax(-1))
        m_safe = torch.where(m_new == NEG_INF, torch.zeros_like(m_new), m_new)
        p = torch.exp2(s - m_safe[..., None])
        alpha = torch.exp2(m_old - m_safe)
        l_new = l_old * alpha + p.sum(-1)
        a_new = a_old * alpha[..., None] + torch.matmul(p, vt)

        acc = accf.index_put((flat,), a_new.reshape(-1, G * R, Dv)).reshape(acc.shape)
        m = mf.index_put((flat,), m_new.reshape(-1, G * R)).reshape(m.shape)
        l = lf.index_put((flat,), l_new.reshape(-1, G * R)).reshape(l.shape)
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
        lse = torch.where(torch.logical_and((lmap >= 0)[:, None], ll > 0), lse, torch.full_like(lse, NEG_INF))
        lse = torch.where(torch.isnan(ll), ll, lse)
        lse = lse.reshape(bl, sl, hq_n).permute(0, 2, 1)
        return to_abi(out, sp.dtype), lse


def _examples(spec: KernelSpec):
    """Example arguments and dynamic dims for torch.export (sizes chosen to be distinct)."""
    from torch.export import Dim

    G, R, Dq, Dv = spec.group, spec.tiles.m0, spec.dq, spec.dv
    B, Sq, Sk, Hk, NT, P = 2, 37, 41, 3, 5, 4
    Hq = Hk * G
    dt = abi_dtype(spec.dtype)
    qshape = (B, Hq, Sq, Dq) if spec.layout == "bhsd" else (B, Sq, Hq, Dq)
    kshape = (B, Hk, Sk, Dq) if spec.layout == "bhsd" else (B, Sk, Hk, Dq)
    vshape = kshape[:3] + (Dv,)
    s_ax, h_ax = (2, 1) if spec.layout == "bhsd" else (1, 2)

    dB, dSq, dSk, dHk, dNT, dP = (Dim(n) for n in ("B", "Sq", "Sk", "Hk", "NT", "P"))
    dHq = dHk * G if G > 1 else dHk
    acc = torch.zeros(NT, Hk, G * R, Dv)
    m = torch.zeros(NT, Hk, G * R)
    state_dims = {0: dNT, 1: dHk}
    init = dict(args=(torch.zeros(NT, Hk, dtype=torch.int32),), dynamic_shapes={"carrier": {0: dNT, 1: dHk}})
    step = dict(
        args=(
            torch.zeros(qshape, dtype=dt), torch.zeros(kshape, dtype=dt), torch.zeros(vshape, dtype=dt),
            torch.ones(1), acc, m, m.clone(), torch.zeros(P, len(DESC_COLUMNS), dtype=torch.int32),
        ),
        dynamic_shapes={
            "q": {0: dB, s_ax: dSq, h_ax: dHq}, "k": {0: dB, s_ax: dSk, h_ax: dHk},
            "v": {0: dB, s_ax: dSk, h_ax: dHk}, "scale": None,
            "acc": state_dims, "m": state_dims, "l": state_dims, "desc": {0: dP},
        },
    )
    dBo, dSo, dBl, dSl = (Dim(n) for n in ("Bo", "So", "Bl", "Sl"))
    fin = dict(
        args=(acc, m, m.clone(), torch.zeros(3, 7, dtype=torch.int32), torch.zeros(2, 9, dtype=torch.int32)),
        dynamic_shapes={
            "acc": state_dims, "m": state_dims, "l": state_dims,
            "out_map": {0: dBo, 1: dSo}, "lse_map": {0: dBl, 1: dSl},
        },
    )
    return init, step, fin


def build_programs(spec: KernelSpec, *, with_step: bool = True):
    """The entry points as an iree-turbine FxProgramsBuilder (``step`` left out when another
    implementation, such as the GPU template, provides it)."""
    from iree.turbine import aot

    class Root(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.init_ = Init(spec)
            self.step_ = Step(spec)
            self.finalize_ = Finalize(spec)

    fxb = aot.FxProgramsBuilder(Root())
    init, step, fin = _examples(spec)

    @fxb.export_program(name="init", args=init["args"], dynamic_shapes=init["dynamic_shapes"])
    def _init(root, carrier):
        return root.init_(carrier)

    if with_step:

        @fxb.export_program(name="step", args=step["args"], dynamic_shapes=step["dynamic_shapes"])
        def _step(root, q, k, v, scale, acc, m, l, desc):
            return root.step_(q, k, v, scale, acc, m, l, desc)

    @fxb.export_program(name="finalize", args=fin["args"], dynamic_shapes=fin["dynamic_shapes"])
    def _finalize(root, acc, m, l, out_map, lse_map):
        return root.finalize_(acc, m, l, out_map, lse_map)

    if with_step:  # the torch (CPU) formulation: whole-key-row entry points (rows.py)
        export_short(fxb, spec)
        for seqlen in spec.seqlens:
            for causal in (False, True):
                for with_lse in (True, False):
                    export_rows(fxb, spec, seqlen, causal, with_lse)

    return fxb


# torch.export keeps its tracing modes on a process-wide stack: two exports at once in two
# threads corrupt each other ("Trying to pop empty mode stack"), so exports take turns.
_EXPORT_LOCK = threading.Lock()


def export_module(spec: KernelSpec, *, with_step: bool = True) -> str:
    """MLIR text (torch dialect) of the module for ``spec``, named after its specialization.
    Safe to call from several threads (exports are serialized)."""
    import warnings

    from iree.turbine import aot

    with _EXPORT_LOCK, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        exported = aot.export(build_programs(spec, with_step=with_step), module_name=spec.module_name)
    return str(exported.mlir_module)
