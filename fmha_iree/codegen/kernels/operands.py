"""The ``fwd`` kernel family's static plan (``Plan``, ``Tier``) and the operands its stages share:
the function's context (``Ctx``), K/V read in place or padded, and Q copied into padded rows
(see ``general.py`` for the function as a whole)."""

from __future__ import annotations

import dataclasses

from .attention import Operand
from .bounds import Coords
from .elementwise import Words, copy_attrs
from .ir import Fn, parallel, tensor_type

__all__ = ["Tier", "Plan", "Ctx", "kv_operand", "kv_padded", "kv_copied", "no_copy", "q_padded", "padded_q_rows"]


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
    rows: int = 512  # prefill group state rows (rows * G) at least
    fill_wgs: int = 132  # groups grow until one op has this many workgroups (the GPU's SMs / CUs)
    max_groups: int = 16  # groups unrolled in the function (rows grow past rows * max_groups)
    short_rows: int = 16  # Sq * G up to this takes the short tier
    split_below: int = 96  # a single group with fewer workgroups than this takes split-KV
    split_target: int = 512  # workgroups split-KV aims for
    max_split: int = 64
    ragged: bool = False  # fwd_ragged: each batch its own lengths and mask (a descriptor per batch)
    # edge masks made in blocks (elementwise.block_attrs); CUDA only: on gfx90a the block lowering
    # spilled 2 SGPRs in the ragged generator (iree-compile 3.13; docs/BENCHMARKS.md, "Copies as
    # 64-bit words, edge masks in blocks")
    mask_blocks: bool = False
    # the banded path for narrow windows (kernels.banded); off on ROCm: its chained masked op
    # spilled 13 SGPRs on gfx942 (iree-compile 3.13), and no AMD GPU measured it (docs/BENCHMARKS.md,
    # "Sliding windows in pages: `kernels.banded`")
    banded: bool = False
    # group mode's tiles over their own keys (kernels.tiles, ``fwd_tiles``); on ROCm where its
    # kernels compile without spills (``source._rocm_tiles``)
    tiles: bool = False
    # the arguments' head dims where they are smaller than dq / dv (0: the same): the work runs at
    # dq / dv over copies zero-padded along the head dim, as CK's kK0max pads 96 to 128 in its tile
    dq_arg: int = 0
    dv_arg: int = 0
    softcap: float = 0.0  # the module's logits soft-cap (mlir_templates.scores), 0 for none
    alibi: bool = False  # ALiBi slopes as an argument (``fwd_tiles`` only: kernels.tiles)
    bias: bool = False  # an elementwise bias as an argument (``fwd_tiles`` only: kernels.tiles)

    @property
    def arg_dims(self) -> tuple[int, int]:
        """(Dq, Dv) of the function's q / k / v arguments and of its out."""
        return self.dq_arg or self.dq, self.dv_arg or self.dv

    @property
    def pads(self) -> bool:
        return self.arg_dims != (self.dq, self.dv)

    @property
    def kv_slots(self) -> bool:
        """Whether paths return padded K / V copies after out and lse (head dims padded, or the
        banded path over keys padded to whole pages)."""
        return self.pads or self.banded


@dataclasses.dataclass
class Ctx:
    """Values shared by the stages of one function."""

    fn: Fn
    p: Plan
    b: str
    hk: str
    hq: str
    sq: str
    sk: str
    co: Coords  # the coordinates the cut uses (one (y, x) pair, or a ragged frame's two)
    scale: str
    k: Operand
    v: Operand
    limit: str  # keys of k / v that can be read (Sk, or the padded length of padded copies)
    desc: tuple[str, str] | None = None  # ragged: (i32 tensor, offset) of [4, B]: rows qlen, klen, y, x
    q: str = "%q"  # the Q tensor ([B, Hq, Sq, Dq] or [B, Sq, Hq, Dq])
    frame: object = None  # ragged: makes q / k / v inside each path and gathers its results (kernels.ragged)
    held: tuple[int, int] = (0, 0)  # head dims (Dq, Dv) k / v have now (0: the plan's arg_dims)

    def dims_held(self) -> tuple[int, int]:
        """Head dims of ``k`` / ``v`` as they are now (copies or frames: the plan's)."""
        return self.held if self.held[0] else self.p.arg_dims


def _ty(shape, elt):
    return tensor_type(shape, elt)


def kv_operand(c: Ctx, which: str, lo: str, keys, pieces: str | None = None) -> Operand:
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


def generated(c: Ctx, ty: str, sizes: list, attrs: str, fill: str, element, elt: str | None = None) -> str:
    """One dispatch making ``ty`` (dynamic ``sizes``; rank 4): a generic over the result whose
    element at indices ``i`` is ``element(i)`` = (valid i1, value) where valid, else ``fill``.
    Reading each element where it is (``tensor.extract``) keeps a padded copy one dispatch: a copy
    stored into a filled tensor became a one-workgroup ``slow_memcpy`` (slow on the H200:
    docs/BENCHMARKS.md, "Head dims without tiles of their own: 96 and 192"). ``elt``: the element
    type (default the plan's dtype)."""
    fn, T = c.fn, elt or c.p.dtype

    def region():
        e = fn.let(f"tensor.empty({', '.join(sizes)}) : {ty}", "e")
        out = fn.fresh("gp")
        fn.emit(f"{out} = linalg.generic {{indexing_maps = [affine_map<(d0, d1, d2, d3) -> (d0, d1, d2, d3)>], "
                f"iterator_types = [{parallel(4)}]}} outs({e} : {ty}){attrs} {{")
        with fn.region(f"^bb0(%gp_o: {T}):", f"}} -> {ty}"), fn.local():
            ok, val = element([fn.let(f"linalg.index {n} : index", "gi") for n in range(4)])
            z = fn.let(f"arith.constant {fill} : {T}", "gz")
            fn.emit(f"linalg.yield {fn.let(f'arith.select {ok}, {val}, {z} : {T}', 'gv')} : {T}")
        return [out]

    return fn.dispatch([(ty, sizes)], region)[0]


def kv_padded(c: Ctx, which: str) -> Operand:
    """K or V copied into ``c.limit`` keys and the plan's head dim (``generated``). Past Sk, V
    holds zeros (a masked key's weight is 0, and 0 * V must be 0) and K ones (any finite value);
    past the argument's head dim K's ones meet Q's zeros (``q_padded``) and V's columns are
    dropped."""
    fn, T = c.fn, c.p.dtype
    src = c.k if which == "k" else c.v
    d = c.p.dq if which == "k" else c.p.dv
    d_src = c.dims_held()[0 if which == "k" else 1]
    ty = _ty(["?", "?", "?", d], T)
    s_dim = 2 if c.p.layout == "bhsd" else 1
    full = [c.b, c.hk, c.limit] if s_dim == 2 else [c.b, c.limit, c.hk]
    w = Words(T, d, d_src)  # moved as 64-bit words where the head dims allow
    src_val, src_ty = w.source(fn, src.name, tag="kd")
    elt, dw, dw_src = w.elt, w.dw, w.dw_src

    def element(at):
        ok = fn.cmp("slt", at[s_dim], c.sk)
        at[s_dim] = fn.min(at[s_dim], fn.sub(c.sk, 1))
        if dw_src < dw:
            ok = fn.andi(ok, fn.cmp("slt", at[3], dw_src))
            at[3] = fn.min(at[3], dw_src - 1)
        return ok, fn.let(f"tensor.extract {src_val}[{', '.join(at)}] : {src_ty}", "kv")

    fill = (str(_ones_word(T)) if w.n else "1.0") if which == "k" else w.zero
    attrs = copy_attrs(c.p.main.lowering, rank=4, row_dim=s_dim, inner=dw, vec=w.vec)
    out = generated(c, _ty(["?", "?", "?", dw], elt), full, attrs, fill, element, elt)
    return Operand(w.result(fn, out, full), ty, src.dims)


def no_copy(fn, d: int, dtype: str) -> str:
    """An empty stand-in for a K / V copy slot (``[0, 0, 0, d]``)."""
    z = fn.c(0)
    return fn.let(f"tensor.empty({z}, {z}, {z}) : {_ty(['?', '?', '?', d], dtype)}", "nc")


def kv_copied(c: Ctx, entered) -> tuple[Ctx, object]:
    """``c`` reading K and V from copies of ``c.limit`` keys (made here unless ``_entered`` made
    them), and what ``_finish`` needs (the copies are transients of the path where it returns
    none: a ragged frame, a plan without ``kv_slots``)."""
    if c.frame is None and c.p.pads:  # _entered's copies already have c.limit keys
        return c, entered
    k, v = kv_padded(c, "k"), kv_padded(c, "v")
    kept = c.frame is None and c.p.kv_slots
    return dataclasses.replace(c, k=k, v=v), ((k.name, v.name) if kept else entered)


def _ones_word(dtype: str) -> int:
    """A 64-bit word of ``dtype`` ones (K's fill past Sk, as words)."""
    bits, one = {"f16": (16, 0x3C00), "bf16": (16, 0x3F80), "f32": (32, 0x3F800000)}[dtype]
    return sum(one << (bits * i) for i in range(64 // bits))


def q_padded(c: Ctx, q_arg: str, m_pad: str) -> str:
    """Q as ``[B, Hk, m_pad, Dq]``, rows ``(s, g)`` (row ``s * G + g``); rows past ``Sq * G`` are
    left unwritten (every row is independent: a padding row only ever reaches its own output row,
    which is dropped); columns past the argument's head dim are zeros (``Plan.pads``,
    ``_q_gathered``). One explicit dispatch: a copy generic stored into the rows it fills (IREE
    lowers an unstructured copy into a slice to a one-workgroup ``slow_memcpy``)."""
    if c.frame is not None:  # a ragged frame's rows, gathered straight into this layout
        return c.frame.q_padded(c, m_pad)
    fn, G, D, T = c.fn, c.p.group, c.p.dq, c.p.dtype
    S = c.p.arg_dims[0]  # the argument's head dim
    if S != D:
        return _q_gathered(c, q_arg, m_pad, S)
    w = Words(T, D, D)  # moved as 64-bit words where the head dim allows
    q_arg, _ = w.source(fn, q_arg, [c.b, c.hq, c.sq] if c.p.layout == "bhsd" else [c.b, c.sq, c.hq])
    E, DW = w.elt, w.dw
    q_ty, a_ty = _ty(["?", "?", "?", DW], E), _ty(["?", "?", "?", DW], E)
    # the loops run in the source's order (IREE turns a copy around that way itself, and the
    # tile of ``copy_attrs`` is given for it): (b, h, g, s, d) for bhsd, (b, s, h, g, d) for bshd
    if c.p.layout == "bhsd":  # q [B, Hk*G, Sq, D] as [B, Hk, G, Sq, D]
        src_ty, dst_map, s_dim = _ty(["?", "?", G, "?", DW], E), "d0, d1, d3, d2, d4", 3
        src = fn.let(f"tensor.expand_shape {q_arg} [[0], [1, 2], [3], [4]] output_shape [{c.b}, {c.hk}, {G}, {c.sq}, {DW}] "
                     f": {a_ty} into {src_ty}", "q")
    else:  # q [B, Sq, Hk*G, D] as [B, Sq, Hk, G, D]
        src_ty, dst_map, s_dim = _ty(["?", "?", "?", G, DW], E), "d0, d2, d1, d3, d4", 1
        src = fn.let(f"tensor.expand_shape {q_arg} [[0], [1], [2, 3], [4]] output_shape [{c.b}, {c.sq}, {c.hk}, {G}, {DW}] "
                     f": {a_ty} into {src_ty}", "q")
    dest = fn.let(f"tensor.empty({c.b}, {c.hk}, {m_pad}) : {q_ty}", "qp")
    rows = fn.mul(c.sq, G)
    t_ty = _ty(["?", "?", "?", G, DW], E)
    attrs = copy_attrs(c.p.main.lowering, rank=5, row_dim=s_dim, inner=DW, vec=w.vec)

    def region():
        e = fn.let(f"tensor.empty({c.b}, {c.hk}, {c.sq}) : {t_ty}", "e")
        d5 = "d0, d1, d2, d3, d4"
        cp = fn.let(f"linalg.generic {{indexing_maps = [affine_map<({d5}) -> ({d5})>, affine_map<({d5}) -> ({dst_map})>], "
                    f"iterator_types = [{parallel(5)}]}} ins({src} : {src_ty}) outs({e} : {t_ty}){attrs} {{\n"
                    f"  ^bb0(%qc_in: {E}, %qc_out: {E}):\n    linalg.yield %qc_in : {E}\n  }} -> {t_ty}", "qc")
        flat = fn.let(f"tensor.collapse_shape {cp} [[0], [1], [2, 3], [4]] : {t_ty} into {a_ty}", "qc")
        return [fn.let(f"tensor.insert_slice {flat} into {dest}[0, 0, 0, 0] [{c.b}, {c.hk}, {rows}, {DW}] [1, 1, 1, 1] "
                       f": {a_ty} into {q_ty}", "ins")]

    out = fn.dispatch([(q_ty, [c.b, c.hk, m_pad])], region)[0]
    return w.result(fn, out, [c.b, c.hk, m_pad])


def _q_gathered(c: Ctx, q_arg: str, m_pad: str, d_src: int) -> str:
    """``q_padded`` for a Q narrower than the plan's head dim (``padded_q_rows`` over the
    argument's own rows)."""
    dyn = [c.b, c.hq, c.sq] if c.p.layout == "bhsd" else [c.b, c.sq, c.hq]

    def read(b, s, head, dd, q, q_ty):
        at = [b, head, s] if c.p.layout == "bhsd" else [b, s, head]
        return None, c.fn.let(f"tensor.extract {q}[{', '.join(at)}, {dd}] : {q_ty}", "qv")

    return padded_q_rows(c, m_pad, d_src, read, (q_arg, dyn))


def padded_q_rows(c: Ctx, m_pad: str, d_src: int, read, q: tuple[str, list[str]]) -> str:
    """``[B, Hk, m_pad, Dq]`` in one dispatch (``generated``): element ``(b, h, s * G + g, d)`` is
    ``read(b, s, h * G + g, d, q, q_ty)`` = (valid i1 or None for always, value) for ``s < Sq``
    and ``d < d_src`` (``s`` and ``d`` clamped into range before the read), zeros elsewhere.
    ``q`` = (the rank-4 source, its three dynamic sizes); ``read`` reads that source as it is
    given (``q``, ``q_ty``): as 64-bit words along the head dim where the head dims allow
    (``elementwise.word_elems``; ``d`` is then a word index)."""
    fn, G, D, T = c.fn, c.p.group, c.p.dq, c.p.dtype
    w = Words(T, D, d_src)
    q_val, q_ty = w.source(fn, q[0], q[1])
    elt, dw, dw_src = w.elt, w.dw, w.dw_src

    def element(at):
        b, h, r, dd = at
        rows = fn.mul(c.sq, G)
        ok = fn.andi(fn.cmp("slt", r, rows), fn.cmp("slt", dd, dw_src))
        r = fn.min(r, fn.sub(rows, 1))
        s, head = fn.floordiv(r, G), fn.add(fn.mul(h, G), fn.arith(f"arith.remsi {r}, {fn.c(G)} : index", "qx"))
        valid, val = read(b, s, head, fn.min(dd, dw_src - 1), q_val, q_ty)
        return (ok if valid is None else fn.andi(ok, valid)), val

    attrs = copy_attrs(c.p.main.lowering, rank=4, row_dim=2, inner=dw, vec=w.vec)
    out = generated(c, _ty(["?", "?", "?", dw], elt), [c.b, c.hk, m_pad], attrs, w.zero, element, elt)
    return w.result(fn, out, [c.b, c.hk, m_pad])
