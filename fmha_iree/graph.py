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

import math
import threading

import torch

from .spec import KernelSpec

__all__ = ["DESC_COLUMNS", "ABI_VERSION", "export_module", "build_programs"]

ABI_VERSION = 1
DESC_COLUMNS = ("tile", "b", "q0", "k0", "qrel0", "krel0", "qlen", "klen", "y", "x")
LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)
NEG_INF = float("-inf")

_TORCH_DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}


def _from_abi(t: torch.Tensor, dtype: str) -> torch.Tensor:
    return t.view(torch.bfloat16) if dtype == "bf16" else t


def _to_abi(t: torch.Tensor, dtype: str) -> torch.Tensor:
    t = t.to(_TORCH_DTYPES[dtype])
    return t.view(torch.int16) if dtype == "bf16" else t


def _abi_dtype(dtype: str) -> torch.dtype:
    return torch.int16 if dtype == "bf16" else _TORCH_DTYPES[dtype]


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
        q, k, v = _from_abi(q, sp.dtype), _from_abi(k, sp.dtype), _from_abi(v, sp.dtype)
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
        return _to_abi(out, sp.dtype), lse


# Rows per block of the CPU entry points at compiled-in lengths (``dense_s<S>``, ``causal_s<S>``).
# Dev CPU (2 cores, f32 B=1 H=8 D=64, 2026-11-30): 128 rows took 33.7 ms at S=1024 against 36.5
# for 256, and 559 ms at S=4096 against 562 (a block's scores, H * R * S floats, stay cache-sized).
CPU_ROWS = 128


class RowBlocks(torch.nn.Module):
    """Attention at a compiled-in length S (Sq == Sk == S) for the CPU: ``CPU_ROWS`` query rows
    at a time against whole key rows, as a plain matmul, exp2-softmax and matmul (IREE's CPU
    matmul and elementwise code is much faster than its attention op, and static shapes let it
    plan every buffer). Causal blocks read only the keys up to their diagonal and mask the last
    ``CPU_ROWS`` of them (row i sees key j iff j <= i), so causal costs about half. Returns
    (out, lse) like ``finalize``, or out alone without ``with_lse`` (the LSE cost ~15% at
    S=1024); no sequence padding (the plan handles that)."""

    def __init__(self, spec: KernelSpec, seqlen: int, causal: bool, with_lse: bool = True):
        super().__init__()
        self.spec, self.seqlen, self.causal, self.with_lse = spec, int(seqlen), bool(causal), bool(with_lse)

    def forward(self, q, k, v, scale):
        sp, S = self.spec, self.seqlen
        G, Dv = sp.group, sp.dv
        R = CPU_ROWS if S % CPU_ROWS == 0 else S
        q, k, v = (_from_abi(x, sp.dtype).to(torch.float32) for x in (q, k, v))
        if sp.layout == "bshd":
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        B, Hq, Hk = q.shape[0], q.shape[1], k.shape[1]
        qs = q * (scale * LOG2E)
        if G > 1:  # the G query heads of a KV head as rows [g*R + r] of one matmul
            qs = qs.reshape(B, Hk, G, S, sp.dq)
        outs, lses = [], []
        for r0 in range(0, S, R):
            end = r0 + R if self.causal else S
            qb = qs[:, :, :, r0:r0 + R].reshape(B, Hk, G * R, sp.dq) if G > 1 else qs[:, :, r0:r0 + R]
            # K sliced, then transposed (slicing a transposed K made IREE copy it per block:
            # S=4096 causal 434 -> 255 ms, unmasked 547 -> 470 ms on the dev CPU, 2026-11-30)
            s = torch.matmul(qb, k[:, :, :end].transpose(2, 3))  # [B, Hk, G*R, end], log2 units
            if self.causal:
                i = torch.arange(r0, r0 + R).repeat(G) if G > 1 else torch.arange(r0, r0 + R)
                j = torch.arange(end)
                s = torch.where(j[None, :] <= i[:, None], s, NEG_INF)
            m = s.amax(-1, keepdim=True)
            p = torch.exp2(s - m)
            l = p.sum(-1, keepdim=True)
            o = torch.matmul(p, v[:, :, :end]) / l
            outs.append(o.reshape(B, Hk, G, R, Dv) if G > 1 else o)  # (5-D only when needed:
            if self.with_lse:  # a 5-D concat for G = 1 doubled the time)
                lse = (m + torch.log2(l)) * LN2
                lses.append(lse.reshape(B, Hk, G, R) if G > 1 else lse)
        out = torch.cat(outs, 3).reshape(B, Hq, S, Dv) if G > 1 else torch.cat(outs, 2)
        if sp.layout == "bshd":
            out = out.transpose(1, 2)
        if not self.with_lse:
            return _to_abi(out, sp.dtype)
        lse = torch.cat(lses, 3).reshape(B, Hq, S) if G > 1 else torch.cat(lses, 2)[..., 0]
        return _to_abi(out, sp.dtype), lse


def _examples(spec: KernelSpec):
    """Example arguments and dynamic dims for torch.export (sizes chosen to be distinct)."""
    from torch.export import Dim

    G, R, Dq, Dv = spec.group, spec.tiles.m0, spec.dq, spec.dv
    B, Sq, Sk, Hk, NT, P = 2, 37, 41, 3, 5, 4
    Hq = Hk * G
    dt = _abi_dtype(spec.dtype)
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

    if with_step:  # the torch (CPU) formulation: row-block entry points at compiled-in lengths
        for seqlen in spec.seqlens:
            for causal in (False, True):
                for with_lse in (True, False):
                    _export_rows(fxb, spec, seqlen, causal, with_lse)

    return fxb


def _export_rows(fxb, spec: KernelSpec, seqlen: int, causal: bool, with_lse: bool):
    from torch.export import Dim

    G, dt = spec.group, _abi_dtype(spec.dtype)
    B, Hk = spec.batch or 2, spec.kv_heads or 3
    s_ax, h_ax = (2, 1) if spec.layout == "bhsd" else (1, 2)

    def shape(h, d):
        return (B, h, seqlen, d) if spec.layout == "bhsd" else (B, seqlen, h, d)

    dB, dHk = Dim("B"), Dim("Hk")
    dHq = dHk * G if G > 1 else dHk
    args = (torch.zeros(shape(Hk * G, spec.dq), dtype=dt), torch.zeros(shape(Hk, spec.dq), dtype=dt),
            torch.zeros(shape(Hk, spec.dv), dtype=dt), torch.ones(1))
    qd, kd = {}, {}  # batch / heads left dynamic unless the spec fixes them
    if not spec.batch:
        qd[0] = kd[0] = dB
    if not spec.kv_heads:
        qd[h_ax], kd[h_ax] = dHq, dHk
    dyn = {"q": qd or None, "k": kd or None, "v": dict(kd) or None, "scale": None}
    mod = RowBlocks(spec, seqlen, causal, with_lse)
    name = f"{'causal' if causal else 'dense'}{'' if with_lse else '_o'}_s{seqlen}"
    setattr(fxb.root_module, name.replace("_s", "_rows_"), mod)

    @fxb.export_program(name=name, args=args, dynamic_shapes=dyn)
    def _rows(root, q, k, v, scale):
        return mod(q, k, v, scale)


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
