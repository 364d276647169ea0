"""The CPU's whole-key-row graphs: query rows against whole key rows as a plain matmul,
exp2-softmax and matmul (IREE's CPU matmul and elementwise code is much faster than its attention
op). ``Rows`` takes any lengths and mask (the entry point ``rows``, for short queries: decode,
chunked prefill); ``RowBlocks`` a compiled-in length (``dense_s<S>``, ``causal_s<S>``)."""

from __future__ import annotations

import torch

from ..problem.spec import KernelSpec
from .torch_abi import LN2, LOG2E, NEG_INF, abi_dtype, from_abi, to_abi


def capped(s: torch.Tensor, softcap: float) -> torch.Tensor:
    """Log2-unit scores ``s`` soft-capped (``mlir_templates.scores``: ``cap * tanh(x / cap)`` on the
    natural-log score); ``s`` itself when ``softcap`` is 0."""
    return torch.tanh(s * (LN2 / softcap)) * (softcap * LOG2E) if softcap else s

__all__ = ["CPU_ROWS", "ROWS_DESC_COLUMNS", "Rows", "RowBlocks", "export_rows", "export_short"]

from ..problem.abi import ROWS_DESC_COLUMNS


class Rows(torch.nn.Module):
    """``rows(q, k, v, scale[1], desc[B, 4]) -> (out, lse)``: every query row of batch ``b``
    against every key of its slot in one matmul, masked by the batch's own lengths and CK
    coordinates ``desc[b] = (qlen, klen, y, x)`` (``ROWS_DESC_COLUMNS``): row ``i`` sees key ``j``
    iff ``i < qlen``, ``j < klen`` and ``i - y + 1 <= j < i + x``. Rows that see no key (and
    padding rows) give 0 and lse -inf. With ``padded_keys`` (the entry point ``rows_kpad``), V
    past ``klen`` is never read (0 * NaN would leak); without it (``rows``) every batch's ``klen``
    must be ``Sk``, which saves a pass over V (measured faster for decode on the dev CPU:
    docs/tried.md, "Whole key rows with runtime lengths: `rows`"). Holds ``B * Hq * Sq * Sk``
    scores, so the dispatcher sends it short queries only (``cpu_calls.rows_fit``)."""

    def __init__(self, spec: KernelSpec, padded_keys: bool):
        super().__init__()
        self.spec, self.padded_keys = spec, bool(padded_keys)

    def forward(self, q, k, v, scale, desc):
        sp = self.spec
        G = sp.group
        q, k, v = (from_abi(x, sp.dtype).to(torch.float32) for x in (q, k, v))
        if sp.layout == "bshd":
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        B, Hq, Sq = q.shape[0], q.shape[1], q.shape[2]
        Hk, Sk = k.shape[1], k.shape[2]
        qlen, klen, y, x = (desc[:, c].reshape(B, 1, 1, 1) for c in range(4))  # int32, as the ABI's
        i = torch.arange(Sq, dtype=torch.int32)
        i = (i.repeat(G) if G > 1 else i)[:, None]  # rows (g, i), g major
        j = torch.arange(Sk, dtype=torch.int32)
        lo = i - y + 1  # [B, 1, G*Sq, 1]
        hi = torch.where(i < qlen, torch.minimum(i + x, klen), torch.zeros_like(lo))
        vis = torch.logical_and(j >= lo, j < hi)  # [B, 1, G*Sq, Sk]
        qs = (q * (scale * LOG2E)).reshape(B, Hk, G * Sq, sp.dq)
        s = torch.where(vis, capped(torch.matmul(qs, k.transpose(2, 3)), sp.softcap), NEG_INF)  # log2 units
        m = s.amax(-1, keepdim=True)
        m = torch.where(m == NEG_INF, torch.zeros_like(m), m)
        p = torch.exp2(s - m)
        l = p.sum(-1, keepdim=True)
        if self.padded_keys:
            v = torch.where(j[:, None] < klen, v, torch.zeros((), dtype=torch.float32))
        keep = torch.logical_or(l > 0, torch.isnan(l))  # NaN inputs stay NaN
        # (B, Hk) as one batch dim: IREE 3.13 ran the 4-D product as one workgroup (the batched form
        # measured faster for decode on the dev CPU in both layouts: docs/BENCHMARKS.md, "CPU: the
        # 2-core x86_64 development machine")
        pv = torch.bmm(p.reshape(B * Hk, G * Sq, Sk), v.reshape(B * Hk, Sk, sp.dv)).reshape(B, Hk, G * Sq, sp.dv)
        o = pv / torch.where(keep, l, torch.ones_like(l))
        lse = torch.where(keep, (m + torch.log2(l)) * LN2, torch.full_like(l, NEG_INF))
        out = o.reshape(B, Hq, Sq, sp.dv)
        if sp.layout == "bshd":
            out = out.transpose(1, 2)
        return to_abi(out, sp.dtype), lse.reshape(B, Hq, Sq)


# Rows per block of the CPU entry points at compiled-in lengths (``dense_s<S>``, ``causal_s<S>``):
# 128 rows a little faster than 256 on the dev CPU (a block's scores, H * R * S floats, stay
# cache-sized; docs/BENCHMARKS.md, "CPU: the 2-core x86_64 development machine").
CPU_ROWS = 128


class RowBlocks(torch.nn.Module):
    """Attention at a compiled-in length S (Sq == Sk == S) for the CPU: ``CPU_ROWS`` query rows
    at a time against whole key rows, as a plain matmul, exp2-softmax and matmul (IREE's CPU
    matmul and elementwise code is much faster than its attention op, and static shapes let it
    plan every buffer). Causal blocks read only the keys up to their diagonal and mask the last
    ``CPU_ROWS`` of them (row i sees key j iff j <= i), so causal costs about half. Returns
    (out, lse) like ``finalize``, or out alone without ``with_lse`` (the LSE costs measurably at
    S=1024: docs/BENCHMARKS.md, "CPU: the 2-core x86_64 development machine"); no sequence padding
    (the plan handles that)."""

    def __init__(self, spec: KernelSpec, seqlen: int, causal: bool, with_lse: bool = True):
        super().__init__()
        self.spec, self.seqlen, self.causal, self.with_lse = spec, int(seqlen), bool(causal), bool(with_lse)

    def forward(self, q, k, v, scale):
        sp, S = self.spec, self.seqlen
        G, Dv = sp.group, sp.dv
        R = CPU_ROWS if S % CPU_ROWS == 0 else S
        q, k, v = (from_abi(x, sp.dtype).to(torch.float32) for x in (q, k, v))
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
            # K sliced, then transposed (slicing a transposed K made IREE copy it per block, slower
            # on the dev CPU: docs/BENCHMARKS.md, "CPU: the 2-core x86_64 development machine")
            s = capped(torch.matmul(qb, k[:, :, :end].transpose(2, 3)), sp.softcap)  # [B, Hk, G*R, end], log2 units
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
            return to_abi(out, sp.dtype)
        lse = torch.cat(lses, 3).reshape(B, Hq, S) if G > 1 else torch.cat(lses, 2)[..., 0]
        return to_abi(out, sp.dtype), lse


def export_short(fxb, spec: KernelSpec):
    """Add ``rows`` and ``rows_kpad`` (:class:`Rows`, every size dynamic) to the FxProgramsBuilder
    ``fxb``."""
    from torch.export import Dim

    G, dt = spec.group, abi_dtype(spec.dtype)
    B, Hk, Sq, Sk = 2, 3, 5, 41  # distinct example sizes
    s_ax, h_ax = (2, 1) if spec.layout == "bhsd" else (1, 2)

    def shape(h, s, d):
        return (B, h, s, d) if spec.layout == "bhsd" else (B, s, h, d)

    dB, dHk, dSq, dSk = Dim("B"), Dim("Hk"), Dim("Sq"), Dim("Sk")
    dHq = dHk * G if G > 1 else dHk
    args = (torch.zeros(shape(Hk * G, Sq, spec.dq), dtype=dt), torch.zeros(shape(Hk, Sk, spec.dq), dtype=dt),
            torch.zeros(shape(Hk, Sk, spec.dv), dtype=dt), torch.ones(1),
            torch.zeros(B, len(ROWS_DESC_COLUMNS), dtype=torch.int32))
    kd = {0: dB, s_ax: dSk, h_ax: dHk}
    dyn = {"q": {0: dB, s_ax: dSq, h_ax: dHq}, "k": kd, "v": dict(kd), "scale": None, "desc": {0: dB}}
    for name, padded in (("rows", False), ("rows_kpad", True)):
        mod = Rows(spec, padded)
        setattr(fxb.root_module, f"{name}_", mod)
        fxb.export_program(name=name, args=args, dynamic_shapes=dyn)(_call_of(mod))


def _call_of(mod):
    def call(root, q, k, v, scale, desc):
        return mod(q, k, v, scale, desc)
    return call


def export_rows(fxb, spec: KernelSpec, seqlen: int, causal: bool, with_lse: bool):
    """Add the row-block entry point of ``seqlen`` (:class:`RowBlocks`) to ``fxb``."""
    from torch.export import Dim

    G, dt = spec.group, abi_dtype(spec.dtype)
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


