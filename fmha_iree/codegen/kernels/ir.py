"""A small builder for the MLIR text of the kernel family: SSA names, index arithmetic, tensor
types, structured regions (``scf.if``, ``flow.dispatch.region``).

Host-side decomposition (the lengths, mask coordinates and the group and edge bounds derived from
them) is ``index`` arithmetic in the exported function: IREE runs it in its VM on the host, from
the buffers' shapes and the scalar arguments, so a call needs no planning in Python and nothing
from the device.
"""

from __future__ import annotations

import contextlib

__all__ = ["Fn", "tensor_type", "parallel"]

_I32_MAX = 2**31 - 1  # the bound of Fn.bounded / assume_div: sizes IREE passes as one 32-bit constant


def tensor_type(shape, elt: str) -> str:
    """``tensor<AxBx...xT>``; ``?`` or None marks a dynamic size."""
    dims = ["?" if d is None or d == "?" else str(int(d)) for d in shape]
    return "tensor<" + "x".join(dims + [elt]) + ">"


def parallel(rank: int) -> str:
    """The ``iterator_types`` entries of ``rank`` parallel loops."""
    return ", ".join(['"parallel"'] * rank)


class Fn:
    """Lines of one ``util.func`` body with fresh SSA names and cached index constants.

    Three sections, in this order: constants (``prologue``), host arithmetic (``host``: every
    index computation outside a ``local`` region, whatever region the caller is in) and the
    ``body`` (tensor ops and control flow, indented by region depth). Host values therefore
    dominate every region: IREE 3.13 carries a ``util.assume.int`` into the dispatches that use
    it only when it is defined at the function's top level, and its transient-emplacement pass
    fails on sizes computed inside ``scf.if`` regions."""

    def __init__(self):
        self.prologue: list[str] = []
        self.host: list[str] = []
        self.body: list[str] = []
        self._n = 0
        self._consts: dict[tuple, str] = {}
        self._depth = 1
        self._local = 0

    def fresh(self, base: str = "v") -> str:
        self._n += 1
        return f"%{base}{self._n}"

    def emit(self, text: str):
        pad = "  " * self._depth
        self.body.extend(pad + ln if ln else ln for ln in text.split("\n"))

    def let(self, expr: str, base: str = "v") -> str:
        """Emit ``%name = expr``; return the name."""
        name = self.fresh(base)
        self.emit(f"{name} = {expr}")
        return name

    def arith(self, expr: str, base: str) -> str:
        """Index arithmetic: to the ``host`` section, or in place inside a ``local`` region."""
        if self._local:
            return self.let(expr, base)
        name = self.fresh(base)
        self.host.append(f"  {name} = {expr}")
        return name

    @contextlib.contextmanager
    def local(self):
        """Index arithmetic stays in the current region (a linalg body: it uses the iteration
        indices)."""
        self._local += 1
        try:
            yield
        finally:
            self._local -= 1

    # ---- constants ----
    def c(self, value: int) -> str:
        """An ``index`` constant (defined once at the top)."""
        key = ("index", int(value))
        if key not in self._consts:
            name = f"%c{int(value)}" if value >= 0 else f"%cm{-int(value)}"
            self._consts[key] = name
            self.prologue.append(f"  {name} = arith.constant {int(value)} : index")
        return self._consts[key]

    def opaque(self, value: int) -> str:
        """An index the compiler cannot fold (an optimization barrier on a constant): ops that
        differ only in such a value compile to one dispatch body instead of one per value."""
        key = ("opaque", int(value))
        if key not in self._consts:
            name = f"%o{int(value)}"
            self._consts[key] = name
            barrier = f"%o{int(value)}b"
            self.prologue.append(f"  {barrier} = util.optimization_barrier {self.c(value)} : index")
            self.prologue.append(f"  {name} = util.assume.int {barrier}<umin = 0, umax = {_I32_MAX}> : index")
        return self._consts[key]

    def const(self, literal: str, ty: str, base: str) -> str:
        key = (ty, literal)
        if key not in self._consts:
            name = f"%{base}"
            self._consts[key] = name
            self.prologue.append(f"  {name} = arith.constant {literal} : {ty}")
        return self._consts[key]

    # ---- index arithmetic (signed) ----
    def _idx(self, v) -> str:
        return self.c(v) if isinstance(v, int) else v

    def add(self, a, b) -> str:
        return self.arith(f"arith.addi {self._idx(a)}, {self._idx(b)} : index", "i")

    def sub(self, a, b) -> str:
        return self.arith(f"arith.subi {self._idx(a)}, {self._idx(b)} : index", "i")

    def mul(self, a, b) -> str:
        return self.arith(f"arith.muli {self._idx(a)}, {self._idx(b)} : index", "i")

    def floordiv(self, a, b) -> str:
        return self.arith(f"arith.floordivsi {self._idx(a)}, {self._idx(b)} : index", "i")

    def ceildiv(self, a, b) -> str:
        return self.arith(f"arith.ceildivsi {self._idx(a)}, {self._idx(b)} : index", "i")

    def min(self, a, b) -> str:
        return self.arith(f"arith.minsi {self._idx(a)}, {self._idx(b)} : index", "i")

    def max(self, a, b) -> str:
        return self.arith(f"arith.maxsi {self._idx(a)}, {self._idx(b)} : index", "i")

    def clamp(self, a, lo, hi) -> str:
        return self.min(self.max(a, lo), hi)

    def round_up(self, a, m: int) -> str:
        return self.mul(self.ceildiv(a, m), m)

    def round_down(self, a, m: int) -> str:
        return self.mul(self.floordiv(a, m), m)

    def cmp(self, pred: str, a, b) -> str:
        return self.arith(f"arith.cmpi {pred}, {self._idx(a)}, {self._idx(b)} : index", "p")

    def select(self, cond: str, a, b) -> str:
        return self.arith(f"arith.select {cond}, {self._idx(a)}, {self._idx(b)} : index", "i")

    def andi(self, a: str, b: str) -> str:
        return self.arith(f"arith.andi {a}, {b} : i1", "p")

    def assume_div(self, v: str, div: int) -> str:
        """``v`` annotated as a non-negative multiple of ``div`` (IREE's GPU pipeline distributes an
        attention op only over sizes it can prove to be whole tiles). Every such value is a count
        along one axis of a tensor, below 2**31 (``umax``: IREE then passes it to a dispatch as one
        32-bit push constant)."""
        return self.arith(f"util.assume.int {v}<umin = 0, umax = {_I32_MAX}, udiv = {int(div)}> : index", "a")

    def bounded(self, v: str) -> str:
        """``v`` annotated as a size below 2**31 (IREE then passes it, and what is derived from it,
        to a dispatch as one 32-bit push constant, not two)."""
        return self.arith(f"util.assume.int {v}<umin = 0, umax = {_I32_MAX}> : index", "a")

    def dim(self, value: str, ty: str, i: int) -> str:
        return self.arith(f"tensor.dim {value}, {self.c(i)} : {ty}", "d")

    # ---- regions ----
    @contextlib.contextmanager
    def region(self, head: str, tail: str = "}"):
        """``head {`` ... ``tail`` with the body indented."""
        self.emit(head)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            self.emit(tail)

    def if_else(self, cond: str, result_types: list[str], then_fn, else_fn) -> list[str]:
        """``scf.if``: ``then_fn()`` / ``else_fn()`` emit their branch and return the values to
        yield. Returns the result names."""
        names = [self.fresh("r") for _ in result_types]
        tys = ", ".join(result_types)
        head = (f"{', '.join(names)} = " if names else "") + f"scf.if {cond}" + (f" -> ({tys})" if names else "") + " {"
        self.emit(head)
        self._depth += 1
        vals = then_fn()
        if names:
            self.emit(f"scf.yield {', '.join(vals)} : {tys}")
        self._depth -= 1
        self.emit("} else {")
        self._depth += 1
        vals = else_fn()
        if names:
            self.emit(f"scf.yield {', '.join(vals)} : {tys}")
        self._depth -= 1
        self.emit("}")
        return names

    def dispatch(self, result_types: list[tuple[str, list[str]]], body_fn) -> list[str]:
        """``flow.dispatch.region``: one dispatch for the ops ``body_fn()`` emits (it returns the
        values to return). ``result_types``: (type, dynamic sizes) per result. Writing a result
        through ``tensor.insert_slice`` inside the region makes IREE store into that slice of the
        destination in place."""
        names = [self.fresh("r") for _ in result_types]
        decl = ", ".join(f"{t}{{{', '.join(d)}}}" if d else t for t, d in result_types)
        self.emit(f"{', '.join(names)} = flow.dispatch.region -> ({decl}) {{")
        self._depth += 1
        vals = body_fn()
        self.emit(f"flow.return {', '.join(vals)} : {', '.join(t for t, _ in result_types)}")
        self._depth -= 1
        self.emit("}")
        return names

    def text(self) -> str:
        return "\n".join(self.prologue + self.host + self.body)
