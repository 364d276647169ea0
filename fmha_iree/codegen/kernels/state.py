"""Online-softmax state tensors: ``acc [*lead, Dv]``, ``mx [*lead]`` (max, log2 units) and
``sm [*lead, 1]`` (sum), f32.

The sum carries a unit dim so that max and sum have different types: IREE folds two empty
tensors of one type into one value (CSE), and an op writing both would then write one buffer
twice; two insert_slices into one tensor in a dispatch are not stored in place either. Slices of
the state are the ops' outs (chained in place) and results are inserted back, so a dispatch
region writes its rows of the state directly.
"""

from __future__ import annotations

import dataclasses

from .attention import Operand
from .ir import Fn, tensor_type

__all__ = ["State", "new_state", "fresh_outs"]

_FMIN = "-3.40282347E+38"


@dataclasses.dataclass(frozen=True)
class State:
    acc: str
    mx: str
    sm: str
    lead: tuple[str, ...]  # sizes of the leading dims (SSA names)
    dv: int

    @property
    def acc_type(self) -> str:
        return tensor_type(["?"] * len(self.lead) + [self.dv], "f32")

    @property
    def mx_type(self) -> str:
        return tensor_type(["?"] * len(self.lead), "f32")

    @property
    def sm_type(self) -> str:
        return tensor_type(["?"] * len(self.lead) + [1], "f32")

    def region_results(self) -> list[tuple[str, list[str]]]:
        """(type, dynamic sizes) of (acc, mx, sm), for ``Fn.dispatch``."""
        return [(t, list(self.lead)) for t in self.types()]

    def types(self) -> list[str]:
        return [self.acc_type, self.mx_type, self.sm_type]

    def names(self) -> list[str]:
        return [self.acc, self.mx, self.sm]

    def with_names(self, names) -> "State":
        return dataclasses.replace(self, acc=names[0], mx=names[1], sm=names[2])

    def _parts(self, offs, sizes):
        """(tensor, its type, offsets, sizes, strides) per part, trailing dims included."""
        o, z = ", ".join(offs), ", ".join(sizes)
        one = ["1"] * len(offs)
        return [(self.acc, self.acc_type, f"{o}, 0", f"{z}, {self.dv}", ", ".join(one + ["1"])),
                (self.mx, self.mx_type, o, z, ", ".join(one)),
                (self.sm, self.sm_type, f"{o}, 0", f"{z}, 1", ", ".join(one + ["1"]))]

    def rows(self, fn: Fn, offs: list[str], sizes: list[str], dims: tuple[str, ...]) -> list[Operand]:
        """The slice at ``offs`` / ``sizes`` (leading dims; a size "1" is dropped) as (acc, max,
        sum) outs indexed by ``dims`` (the op's dims of the kept ones)."""
        n = sum(z != "1" for z in sizes)
        tys = [tensor_type(["?"] * n + [self.dv], "f32"), tensor_type(["?"] * n, "f32"), tensor_type(["?"] * n, "f32")]
        out = []
        for (src, src_ty, o, z, st), ty, d in zip(self._parts(offs, sizes), tys, (dims + ("n",), dims, dims)):
            out.append(Operand(fn.let(f"tensor.extract_slice {src}[{o}] [{z}] [{st}] : {src_ty} to {ty}", "ss"), ty, d))
        return out

    def insert(self, fn: Fn, vals: list[str], offs: list[str], sizes: list[str]) -> list[str]:
        """Insert op results (acc, max, sum) at ``offs`` / ``sizes``; a size "1" is a dim the
        results do not have. Returns the new (acc, mx, sm) names."""
        kept = ["?" for z in sizes if z != "1"]
        srcs = [tensor_type(kept + [self.dv], "f32"), tensor_type(kept, "f32"), tensor_type(kept, "f32")]
        return [fn.let(f"tensor.insert_slice {v} into {dst}[{o}] [{z}] [{st}] : {src} into {dst_ty}", "ins")
                for v, src, (dst, dst_ty, o, z, st) in zip(vals, srcs, self._parts(offs, sizes))]


def new_state(fn: Fn, lead: list[str], dv: int) -> State:
    """Uninitialized state of ``lead`` sizes (every element must be written before it is read)."""
    st = State("", "", "", tuple(lead), dv)
    d = ", ".join(lead)
    return st.with_names([fn.let(f"tensor.empty({d}) : {t}", "st") for t in st.types()])


def fresh_outs(fn: Fn, sizes: list[str], dims: tuple[str, ...], dv: int) -> list[Operand]:
    """(acc, max, sum) at (0, -FLT_MAX, 0) of ``sizes`` (inside a dispatch region), indexed by
    ``dims``."""
    zero, fmin = fn.const("0.0", "f32", "zero"), fn.const(_FMIN, "f32", "fmin")
    a_ty = tensor_type(["?"] * len(sizes) + [dv], "f32")
    s_ty = tensor_type(["?"] * len(sizes), "f32")
    d = ", ".join(sizes)

    def fill(value, ty):
        return fn.let(f"linalg.fill ins({value} : f32) outs({fn.let(f'tensor.empty({d}) : {ty}', 'e')} : {ty}) -> {ty}", "f")

    return [Operand(fill(zero, a_ty), a_ty, dims + ("n",)), Operand(fill(fmin, s_ty), s_ty, dims),
            Operand(fill(zero, s_ty), s_ty, dims)]
