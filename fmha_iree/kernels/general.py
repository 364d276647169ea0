"""``fwd``: batch-mode attention for any lengths and any CK mask in one call (runtime lengths).

Signature (``layout`` "bhsd" shown; "bshd" swaps the S and H axes of q, k, v and out)::

    fwd(q [B, Hq, Sq, Dq], k [B, Hk, Sk, Dq], v [B, Hk, Sk, Dv], scale: f32, y: i64, x: i64,
        workspace) -> (out [B, Hq, Sq, Dv], lse [B, Hq, Sq] f32)

``(y, x)`` are CK's mask coordinates for this problem (row ``s`` sees keys
``s - y + 1 <= j < s + x``); every size is a runtime value. Q is copied once into padded rows
``(s, g)`` per KV head (so the G query heads of a KV head share every K/V tile); K and V are read
in place. The function's index arithmetic (run by IREE on the host) cuts the problem:

* prefill: rows in groups of ``R`` (``Plan.rows``, raised so that at most ``Plan.max_groups``
  groups cover Sq; all of Sq when no row is limited). Per group one op over its interior (no mask,
  ``L``-key columns) and, chained through the online-softmax state, one masked op per non-empty
  edge (``bounds``); masked-out key blocks outside a group's union are never read.
* split-KV (one group with too few workgroups to fill the GPU, e.g. decode): the interior cut into
  ``P`` pieces as a batch dim (plus single leftover columns), each piece and edge writing its own
  state slot, slots merged through their max/sum (``finalize.combine_slots``).
* short queries (``Sq * G <= Plan.short_rows``) take the split-KV path with their own lowering
  (``Plan.short``: 16-row tiles).
"""

from __future__ import annotations

import dataclasses

from .attention import Operand
from .ir import Fn, tensor_type

__all__ = ["Tier", "Plan", "render_fwd"]

@dataclasses.dataclass(frozen=True)
class Tier:
    """One set of kernels: the op lowering (None: IREE's own) and its workgroup rows (the
    padding unit of M)."""

    lowering: object
    tile_rows: int


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static parameters of a ``fwd`` function."""

    dtype: str
    layout: str
    group: int
    dq: int
    dv: int
    main: Tier
    short: Tier | None
    cols: int = 64  # L: interior K2 is a multiple of it (a multiple of every tier's K2 tile)
    rows: int = 512  # prefill group rows at least (a multiple of main.tile_rows)
    fill_wgs: int = 132  # groups grow until one op has this many workgroups (the GPU's SMs / CUs)
    max_groups: int = 16  # groups unrolled in the function (rows grow past rows * max_groups)
    short_rows: int = 16  # Sq * G up to this takes the short tier
    split_below: int = 96  # a single group with fewer workgroups than this takes split-KV
    split_target: int = 512  # workgroups split-KV aims for
    max_split: int = 64


@dataclasses.dataclass
class _Ctx:
    """Values shared by the stages of one function."""

    fn: Fn
    p: Plan
    b: str
    hk: str
    hq: str
    sq: str
    sk: str
    y: str
    x: str
    scale: str
    k: Operand
    v: Operand


def _ty(shape, elt):
    return tensor_type(shape, elt)


def kv_operand(c: _Ctx, which: str, lo: str, keys, pieces: str | None = None) -> Operand:
    """K or V keys ``[lo, lo + keys)`` read in place; with ``pieces``, ``pieces`` consecutive runs of
    ``keys`` keys each (a batch dim b2). ``keys`` may be an int (a static size)."""
    fn, src = c.fn, (c.k if which == "k" else c.v)
    d = c.p.dq if which == "k" else c.p.dv
    kdim = "k1" if which == "k" else "n"
    bhsd = c.p.layout == "bhsd"
    size = keys if pieces is None else fn.mul(pieces, keys)
    size = fn._idx(size)
    off = f"[0, 0, {lo}, 0] [{c.b}, {c.hk}, {size}, {d}]" if bhsd else f"[0, {lo}, 0, 0] [{c.b}, {size}, {c.hk}, {d}]"
    ty4 = _ty(["?", "?", "?", d], c.p.dtype)
    sl = fn.let(f"tensor.extract_slice {src.name}{off} [1, 1, 1, 1] : {ty4} to {ty4}", "kv")
    if pieces is None:
        return Operand(sl, ty4, ("b0", "b1", "k2", kdim) if bhsd else ("b0", "k2", "b1", kdim))
    kst = keys if isinstance(keys, int) else "?"
    kval = str(keys) if isinstance(keys, int) else keys
    if bhsd:
        ty5 = _ty(["?", "?", "?", kst, d], c.p.dtype)
        ex = fn.let(f"tensor.expand_shape {sl} [[0], [1], [2, 3], [4]] output_shape [{c.b}, {c.hk}, {pieces}, {kval}, {d}] "
                    f": {ty4} into {ty5}", "kv")
        return Operand(ex, ty5, ("b0", "b1", "b2", "k2", kdim))
    ty5 = _ty(["?", "?", kst, "?", d], c.p.dtype)
    ex = fn.let(f"tensor.expand_shape {sl} [[0], [1, 2], [3], [4]] output_shape [{c.b}, {pieces}, {kval}, {c.hk}, {d}] "
                f": {ty4} into {ty5}", "kv")
    return Operand(ex, ty5, ("b0", "b2", "k2", "b1", kdim))


def q_padded(c: _Ctx, q_arg: str, m_pad: str) -> str:
    """Q as ``[B, Hk, m_pad, Dq]``, rows ``(s, g)`` (row ``s * G + g``); rows past ``Sq * G`` are
    left unwritten (every row is independent: a padding row only ever reaches its own output row,
    which is dropped). One explicit dispatch: a copy generic stored into the rows it fills (IREE
    lowers an unstructured copy into a slice to a one-workgroup ``slow_memcpy``)."""
    fn, G, D, T = c.fn, c.p.group, c.p.dq, c.p.dtype
    q_ty = _ty(["?", "?", "?", D], T)
    if c.p.layout == "bhsd":  # q [B, Hk*G, Sq, D] read as (b, h, g, s, d)
        src = fn.let(f"tensor.expand_shape {q_arg} [[0], [1, 2], [3], [4]] output_shape [{c.b}, {c.hk}, {G}, {c.sq}, {D}] "
                     f": {q_ty} into {_ty(['?', '?', G, '?', D], T)}", "q")
        src_ty, src_map = _ty(["?", "?", G, "?", D], T), "d0, d1, d3, d2, d4"
    else:  # q [B, Sq, Hk*G, D] read as (b, s, h, g, d)
        src = fn.let(f"tensor.expand_shape {q_arg} [[0], [1], [2, 3], [4]] output_shape [{c.b}, {c.sq}, {c.hk}, {G}, {D}] "
                     f": {q_ty} into {_ty(['?', '?', '?', G, D], T)}", "q")
        src_ty, src_map = _ty(["?", "?", "?", G, D], T), "d0, d2, d1, d3, d4"
    dest = fn.let(f"tensor.empty({c.b}, {c.hk}, {m_pad}) : {q_ty}", "qp")
    rows = fn.mul(c.sq, G)
    t_ty = _ty(["?", "?", "?", G, D], T)

    def region():
        e = fn.let(f"tensor.empty({c.b}, {c.hk}, {c.sq}) : {t_ty}", "e")
        d5 = "d0, d1, d2, d3, d4"
        par = ", ".join(['"parallel"'] * 5)
        cp = fn.let(f"linalg.generic {{indexing_maps = [affine_map<({d5}) -> ({src_map})>, affine_map<({d5}) -> ({d5})>], "
                    f"iterator_types = [{par}]}} ins({src} : {src_ty}) outs({e} : {t_ty}) {{\n"
                    f"  ^bb0(%qc_in: {T}, %qc_out: {T}):\n    linalg.yield %qc_in : {T}\n  }} -> {t_ty}", "qc")
        flat = fn.let(f"tensor.collapse_shape {cp} [[0], [1], [2, 3], [4]] : {t_ty} into {q_ty}", "qc")
        return [fn.let(f"tensor.insert_slice {flat} into {dest}[0, 0, 0, 0] [{c.b}, {c.hk}, {rows}, {D}] [1, 1, 1, 1] "
                       f": {q_ty} into {q_ty}", "ins")]

    return fn.dispatch([(q_ty, [c.b, c.hk, m_pad])], region)[0]


def render_fwd(plan: Plan, func_name: str = "fwd") -> str:
    """The MLIR text of ``util.func public @func_name`` (see the module docstring)."""
    from .general_paths import body

    fn = Fn()
    p = plan
    T, D, DV = p.dtype, p.dq, p.dv
    ty_q, ty_k, ty_v = _ty(["?", "?", "?", D], T), _ty(["?", "?", "?", D], T), _ty(["?", "?", "?", DV], T)
    s_ax, h_ax = (2, 1) if p.layout == "bhsd" else (1, 2)
    # sizes below 2**31 (a problem is validated before it is called): IREE then passes derived
    # sizes as single 32-bit push constants (fewer scalar registers per dispatch)
    bounded = lambda v: fn.arith(f"util.assume.int {v}<umin = 0, umax = 2147483647> : index", "a")  # noqa: E731
    b = bounded(fn.dim("%q", ty_q, 0))
    sq, hq = bounded(fn.dim("%q", ty_q, s_ax)), bounded(fn.dim("%q", ty_q, h_ax))
    sk, hk = bounded(fn.dim("%k", ty_k, s_ax)), bounded(fn.dim("%k", ty_k, h_ax))
    y = fn.arith("arith.index_cast %y : i64 to index", "y")
    x = fn.arith("arith.index_cast %x : i64 to index", "x")
    scale = "%scale" if T == "f32" else fn.arith(f"arith.truncf %scale : f32 to {T}", "sc")
    kd = ("b0", "b1", "k2", "k1") if p.layout == "bhsd" else ("b0", "k2", "b1", "k1")
    vd = kd[:3] + ("n",)
    c = _Ctx(fn, p, b, hk, hq, sq, sk, y, x, scale, Operand("%k", ty_k, kd), Operand("%v", ty_v, vd))
    out, out_ty, lse, lse_ty = body(c)
    # No caller-owned workspace (iree.abi.transients): IREE 3.13's transient emplacement
    # miscompiles this function's packed intermediates (offset arithmetic placed inside an execution
    # region; sizes used before they are defined), so IREE allocates them per call.
    args = f"%q: {ty_q}, %k: {ty_k}, %v: {ty_v}, %scale: f32, %y: i64, %x: i64"
    return (f"util.func public @{func_name}({args}) -> ({out_ty}, {lse_ty}) {{\n" + fn.text()
            + f"\n  util.return {out}, {lse} : {out_ty}, {lse_ty}\n}}\n")
