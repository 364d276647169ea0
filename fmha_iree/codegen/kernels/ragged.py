"""``fwd_ragged``: a ragged problem (group mode, cu_seqlen padding, a paged cache) in one call,
as a padded frame whose batch entries each carry their own lengths and CK mask.

Signature (``layout`` of the module; ``bshd`` shown)::

    fwd_ragged(q [Nq, Rq, Hq, Dq], k [Nk, Rk, Hk, Dq], v [Nk, Rk, Hk, Dv], idx: i32 [L], scale: f32,
               B, Sq, Sk, NP, P, No, Ro, Nl, Rl, y, x, yu, xu, khi, khiu, U, nb0 .. nb15: i64)
        -> (out [No, Ro, Hq, Dv], lse [Nl, Hq, Rl] f32, scratch...)

``q`` / ``k`` / ``v`` are read as rows (``n * R + r``): group mode's packed ``[1, T, H, D]``, a
paged cache ``[pages, page_size, H, D]``, a padded batch ``[B, S, H, D]``. ``idx`` holds, one
after the other: the source row of each frame query row ``[B, Sq]`` (-1: none, zeros), the keys'
row bases ``[B, NP]`` (key ``j < klen`` of sequence ``b`` is row ``base[b, j // P] + j % P``: a
paged cache's block table times its page size ``P``, or a contiguous sequence's start with
``P = Sk``; ``frames.PagedRows``), the descriptor ``[4, B]`` (rows qlen, klen, y, x: each sequence's lengths and CK
coordinates), the frame row of each output row ``[No, Ro]`` and of each LSE column ``[Nl, Rl]``
(-1: zeros / -inf). The scalars are those sizes and the frame's interior and union coordinates
(``bounds.Coords``), then the prefix table (``PREFIX_SCALARS``: entries ordered longest first,
``frames.Frame.by_length``, so that a group of rows computes only the entries with rows in it).
The work: K and V gathered into the frame (``frames.gather_rows``), Q gathered straight into
the padded rows the ops read (``_Frame.q_padded``), ``fwd``'s cut of it (``general.fwd_body``: the interior shared by every sequence, edges masked per
sequence), two gathers out. The frames come back among the scratch results, which the caller
drops (``general``: allocated like outputs, freed without a host wait).
"""

from __future__ import annotations

import dataclasses

from .attention import Operand
from .bounds import PREFIX_STEPS, Coords, prefix_entries
from .frames import ExplicitRows, PagedRows, gather_lse, gather_rows, rows_dims
from .general import fwd_body
from .ir import Fn, tensor_type
from .operands import Ctx, Plan, padded_q_rows
from .packed import MASK3, PACKED_SCALARS, gather_pages, packed_host, packed_work
from .state import State

__all__ = ["render_ragged", "render_packed", "RAGGED_SCALARS", "PREFIX_SCALARS", "PACKED_SCALARS"]

from ...problem.abi import RAGGED_SCALARS
# fwd_ragged's own: the frame's entries with rows at or past row i * U lead its batch
# (frames.Frame.prefix); a group of rows computes only those
from ...problem.abi import PREFIX_SCALARS
_SIZES = RAGGED_SCALARS[:9]


@dataclasses.dataclass(frozen=True)
class _Frame:
    """``Ctx.frame`` of ``fwd_ragged``: each path gathers its own Q / K / V frames first and its
    results last (values made before the path's ``scf.if`` would cross it, and IREE would wait on
    the host for them)."""

    s: dict  # the scalars (index values)
    at: dict  # offsets into %idx of q, k, desc, out, lse
    heads: tuple[str, str]  # Hq, Hk
    src_rows: tuple[str, str, str]  # rows per leading index of %q, %k, %v
    plan: Plan

    def types(self) -> list[str]:
        """The scratch results a path adds: the K / V frames, then the frame's out and lse
        (returned, not left as transients: IREE 3.13's CUDA HAL frees a transient with a host wait
        for the call's last kernel). Q has no frame of its own (``q_padded``)."""
        p = self.plan
        return [self._ty(p.dq), self._ty(p.dv), self._ty(p.arg_dims[1]), tensor_type(["?", "?", "?"], "f32")]

    def _ty(self, d: int) -> str:
        return tensor_type(["?", "?", "?", d], self.plan.dtype)

    @staticmethod
    def q_dims(c: Ctx) -> list[str]:
        """The three dynamic sizes of ``%q``."""
        ty = tensor_type(["?", "?", "?", c.p.arg_dims[0]], c.p.dtype)
        return [c.fn.dim("%q", ty, i) for i in range(3)]

    def _gather(self, c: Ctx, src: str, src_rows: str, rows, size, heads: str, d: int, d_src: int) -> str:
        lay = c.p.layout
        return gather_rows(c.fn, src=src, src_layout=lay, src_rows=src_rows, rows=rows, size=size, heads=heads,
                           out_layout=lay, dtype=c.p.dtype, d=d, d_src=d_src, lowering=c.p.main.lowering)

    def entries(self, c: Ctx, row: str) -> str:
        """The leading batch entries that hold every entry with a query row at or past ``row``
        (all ``B`` where the function has no ``PREFIX_SCALARS``)."""
        if "U" not in self.s:
            return c.b
        return prefix_entries(c.fn, row, self.s["U"], [self.s[f"nb{i}"] for i in range(PREFIX_STEPS)], c.b)

    def enter(self, c: Ctx):
        s, (_, hk), at = self.s, self.heads, self.at
        keys = PagedRows("%idx", at["k"], s["NP"], s["P"], c.fn.add(at["desc"], s["B"]))  # klen: the desc's row 1
        (dq, dv), (aq, av) = (c.p.dq, c.p.dv), c.p.arg_dims  # frames at the plan's head dims, zero-padded
        kf = self._gather(c, "%k", self.src_rows[1], keys, (s["B"], s["Sk"]), hk, dq, aq)
        vf = self._gather(c, "%v", self.src_rows[2], keys, (s["B"], s["Sk"]), hk, dv, av)
        c = dataclasses.replace(c, k=Operand(kf, c.k.type, c.k.dims), v=Operand(vf, c.v.type, c.v.dims),
                                held=(c.p.dq, c.p.dv))
        return c, (kf, vf)

    def q_padded(self, c: Ctx, m_pad: str) -> str:
        """``operands.q_padded`` of the frame (``padded_q_rows``): row ``s`` of entry ``b`` is
        Q's source row ``idx[b, s]`` (zeros for -1), gathered from ``%q`` in one dispatch, not as a
        frame of its own and then a padded copy (one dispatch and one frame-sized buffer fewer:
        docs/BENCHMARKS.md, "Group-mode prefill: each group of rows over the sequences it holds")."""
        fn, p, s = c.fn, c.p, self.s
        idx_ty, rows = tensor_type(["?"], "i32"), self.src_rows[0]

        def read(b, sr, head, dd, q, q_ty):
            at = fn.add(self.at["q"], fn.add(fn.mul(b, s["Sq"]), sr))
            row = fn.let(f"arith.index_cast {fn.let(f'tensor.extract %idx[{at}] : {idx_ty}', 'qi')} : i32 to index", "qr")
            safe = fn.max(row, 0)
            n, rr = fn.floordiv(safe, rows), fn.arith(f"arith.remsi {safe}, {rows} : index", "qr")
            src = [n, rr, head] if p.layout == "bshd" else [n, head, rr]
            return fn.cmp("sge", row, 0), fn.let(f"tensor.extract {q}[{', '.join(src)}, {dd}] : {q_ty}", "qv")

        return padded_q_rows(c, m_pad, p.arg_dims[0], read, ("%q", self.q_dims(c)))

    def leave(self, c: Ctx, entered, results: list[str]) -> list[str]:
        s, hq = self.s, self.heads[0]
        dv = c.p.arg_dims[1]
        out = self._gather(c, results[0], s["Sq"], ExplicitRows("%idx", self.at["out"]), (s["No"], s["Ro"]), hq, dv, dv)
        lse = gather_lse(c.fn, lse=results[1], idx=("%idx", self.at["lse"]), size=(s["Nl"], s["Rl"]), heads=hq,
                         rows=s["Sq"])
        return [out, lse, *entered, *results]


def _prologue(fn: Fn, p: Plan, scalars: tuple[str, ...]):
    """The scalars as index values, the table's offsets and the frame object (``_Frame``)."""
    ty_q, ty_v = (tensor_type(["?", "?", "?", d], p.dtype) for d in p.arg_dims)
    s = {n: fn.arith(f"arith.index_cast %{n} : i64 to index", n) for n in scalars}
    s.update({n: fn.bounded(s[n]) for n in _SIZES})  # one value per size in every dispatch that reads it
    at = {"q": fn.c(0), "k": fn.mul(s["B"], s["Sq"])}
    at["desc"] = fn.add(at["k"], fn.mul(s["B"], s["NP"]))
    at["out"] = fn.add(at["desc"], fn.mul(4, s["B"]))
    at["lse"] = fn.add(at["out"], fn.mul(s["No"], s["Ro"]))
    at["first"] = fn.add(at["lse"], fn.mul(s["Nl"], s["Rl"]))
    r_ax, h_ax = rows_dims(p.layout)
    hq, hk = fn.bounded(fn.dim("%q", ty_q, h_ax)), fn.bounded(fn.dim("%k", ty_q, h_ax))
    rows = (fn.dim("%q", ty_q, r_ax), fn.dim("%k", ty_q, r_ax), fn.dim("%v", ty_v, r_ax))
    return s, at, _Frame(s, at, (hq, hk), rows, p)


def _function(fn: Fn, p: Plan, func_name: str, scalars: tuple[str, ...], results) -> str:
    names, types = ", ".join(n for n, _ in results), ", ".join(t for _, t in results)
    ty_q, ty_v = (tensor_type(["?", "?", "?", d], p.dtype) for d in p.arg_dims)
    args = (f"%q: {ty_q}, %k: {ty_q}, %v: {ty_v}, %idx: {tensor_type(['?'], 'i32')}, %scale: f32, "
            + ", ".join(f"%{n}: i64" for n in scalars))
    return (f"util.func public @{func_name}({args}) -> ({types}) {{\n" + fn.text()
            + f"\n  util.return {names} : {types}\n}}\n")


def render_ragged(plan: Plan, func_name: str = "fwd_ragged") -> str:
    """The MLIR text of ``util.func public @func_name`` (see the module docstring)."""
    fn, p = Fn(), plan
    scalars = RAGGED_SCALARS + PREFIX_SCALARS
    s, at, frame = _prologue(fn, p, scalars)
    hq, hk = frame.heads
    co = lambda: Coords(s["y"], s["x"], s["yu"], s["xu"], s["khi"], s["khiu"])  # noqa: E731
    results = fwd_body(fn, p, "%q", "%k", "%v", co, desc=("%idx", at["desc"]), sizes=(s["B"], s["Sq"], hq, s["Sk"], hk),
                       frame=frame)
    return _function(fn, p, func_name, scalars, results)


def render_packed(plan: Plan, func_name: str = "fwd_packed", mode: str = "rows") -> str:
    """``fwd_ragged``'s arguments plus ``kernels.packed``'s scalars (and its table after the
    frame's): the frame's problem with K / V read in place, for the problems the host found
    packed (``frames.packed_pieces``). ``mode="gathered"`` (scalars ``NU``, ``PG``, and after the
    pieces' table each page's first row ``pb [NU]``, its rows in use ``pv [NU]`` and each
    sequence's first row ``starts [B]`` in the gathered pages): the sequences' keys are first
    gathered as pages of ``PG`` rows one after the other, the unused end of each sequence's last
    page zeroed (``frames.gathered_pieces``: a paged cache's pages, or runs with gaps).
    ``mode="pages"`` (the same scalars; the table: the used pages' numbers ``pid [NU]``, each
    sequence's last page's first row ``pb [B]`` and rows in use ``pv [B]``, ``starts [B]``): a
    paged cache's pages read in place, only each sequence's last page copied
    (``frames.page_pieces``). Functions of their own: as a path of ``fwd_ragged``'s ``scf.if``
    chain the pieces sent IREE 3.13's stream canonicalization into an endless rewrite."""
    fn, p = Fn(), plan
    paged = mode != "rows"
    scalars = RAGGED_SCALARS + PACKED_SCALARS + (("NU", "PG") if paged else ())
    s, at, frame = _prologue(fn, p, scalars)
    hq, hk = frame.heads
    scale = "%scale" if p.dtype == "f32" else fn.arith(f"arith.truncf %scale : f32 to {p.dtype}", "sc")
    ty_q, ty_v = (tensor_type(["?", "?", "?", d], p.dtype) for d in p.arg_dims)
    c = Ctx(fn, p, s["B"], hk, hq, s["Sq"], s["Sk"], Coords.uniform(s["y"], s["x"]), scale, Operand("%k", ty_q, ()),
            Operand("%v", ty_v, ()), s["Sk"], desc=("%idx", at["desc"]), frame=frame)
    kv = []
    if paged:
        s["NU"], s["PG"] = fn.bounded(s["NU"]), fn.bounded(s["PG"])
        tails = s["B"] if mode == "pages" else fn.c(1)
        at["pid"] = at["pb"] = fn.add(at["first"], fn.add(s["NPc"], tails))
        if mode == "pages":
            at["pb"] = fn.add(at["pid"], s["NU"])
        at["pv"] = fn.add(at["pb"], s["NU"] if mode == "gathered" else s["B"])
        at["starts"] = fn.add(at["pv"], s["NU"] if mode == "gathered" else s["B"])
    h = packed_host(c, s, at, frame.src_rows[1], mode)
    if paged:
        n = s["B"] if mode == "pages" else None
        kv = [gather_pages(c, h, at, "k", n), gather_pages(c, h, at, "v", n)]
        h = dataclasses.replace(h, k_src=kv[0], v_src=kv[1])
    names = frame.leave(c, kv, packed_work(c, h, frame.src_rows[0]))
    f_ty = [tensor_type(["?", "?", "?", p.arg_dims[1]], p.dtype), tensor_type(["?", "?", "?"], "f32")]
    st = State("", "", "", ("", "", "", ""), p.dv)
    q_ty = tensor_type(["?", "?", "?", p.dq], p.dtype)
    types = [*f_ty, *([ty_q, ty_v] if paged else []), *f_ty, *([q_ty] if mode == "pages" else []), q_ty, MASK3,
             *st.types()]
    return _function(fn, p, func_name, scalars, list(zip(names, types)))
