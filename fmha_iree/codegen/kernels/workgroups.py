"""A builder for ``flow.dispatch.workgroups`` regions: dispatches whose body is written for one
workgroup, reading its own ids (``flow.dispatch.workgroup.id``) and the slices it needs of its
operands (``kernels.tiles``). The region is isolated from the function, so its constants are its
own (``Body``); tensors come in as dispatch tensors tied to their sizes and are read and written
with ``load`` / ``store``."""

from __future__ import annotations

from .ir import Fn

__all__ = ["Body", "workgroups", "load", "store", "is_tensor", "inner_size"]


class Body:
    """Lines of one ``flow.dispatch.workgroups`` body: it is isolated from the function, so its
    constants are its own."""

    def __init__(self, fn: Fn):
        self.fn = fn
        self.consts: dict[int, str] = {}

    def c(self, v: int) -> str:
        if v not in self.consts:
            self.consts[v] = self.fn.let(f"arith.constant {v} : index", "wc")
        return self.consts[v]

    def let(self, expr: str) -> str:
        return self.fn.let(expr, "w")


def workgroups(fn: Fn, grid: tuple[str, str], operands: list[tuple[str, str, list[str]]],
                results: list[tuple[str, list[str]]], body) -> list[str]:
    """``flow.dispatch.workgroups[grid]``: ``operands`` (name, type, dynamic sizes; index scalars
    with type ``index``), ``results`` (type, sizes). ``body(b, args, outs)`` gets the body's
    builder, the operands' bound views (tensors tied to their sizes) and the results' views."""
    names = [fn.fresh("wr") for _ in results]
    sizes = [d for _, ty, ds in operands for d in ds if is_tensor(ty)] + [d for _, ds in results for d in ds]
    index_args = [n for n, ty, _ in operands if ty == "index"]
    # every size the body needs travels as an index operand
    extra = [s for s in dict.fromkeys(sizes) if s not in index_args]
    ops = [(n, ty, ds) for n, ty, ds in operands] + [(s, "index", []) for s in extra]
    sig = ", ".join(f"{ty}{{{', '.join(ds)}}}" if ds else ty for _, ty, ds in ops)
    res = ", ".join(f"{ty}{{{', '.join(ds)}}}" for ty, ds in results)
    caps, inner = [], {}
    for i, (n, ty, ds) in enumerate(ops):
        cap = f"%wa{i}_{fn.fresh('x')[1:]}"
        inner[n] = cap
        caps.append(f"{cap}: " + (_dispatch_type("readonly", ty) if is_tensor(ty) else ty))
    out_caps = [f"%wo{i}_{fn.fresh('x')[1:]}" for i in range(len(results))]
    caps += [f"{cap}: {_dispatch_type('writeonly', ty)}" for cap, (ty, _) in zip(out_caps, results)]
    head = (f"{', '.join(names)} = flow.dispatch.workgroups[{grid[0]}, {grid[1]}]({', '.join(n for n, _, _ in ops)}) : "
            f"({sig}) -> ({res}) =\n    ({', '.join(caps)}) {{")
    tail = ("} count(%wgx: index, %wgy: index) -> (index, index, index) {\n"
            "  %wg1 = arith.constant 1 : index\n"
            "  flow.return %wgx, %wgy, %wg1 : index, index, index\n"
            "}")
    with fn.region(head, tail), fn.local():
        b = Body(fn)

        def bound(cap: str, mode: str, ty: str, ds: list[str]):
            """The capture tied to its sizes: (value, dispatch type, sizes inside the body)."""
            dty, dims = _dispatch_type(mode, ty), [inner[d] for d in ds]
            return b.let(f"flow.dispatch.tie_shape {cap} : {dty}{{{', '.join(dims)}}}"), dty, dims

        args = {n: bound(inner[n], "readonly", ty, ds) if is_tensor(ty) else inner[n] for n, ty, ds in ops}
        outs = [bound(cap, "writeonly", ty, ds) for cap, (ty, ds) in zip(out_caps, results)]
        body(b, args, outs)
        fn.emit("flow.return")
    return names


def _dispatch_type(mode: str, ty: str) -> str:
    return f"!iree_tensor_ext.dispatch.tensor<{mode}:{ty}>"


def inner_size(ty: str) -> int:
    """The last (static) size of a tensor type."""
    return int(ty[len("tensor<"):-1].split("x")[-2])


def is_tensor(ty: str) -> bool:
    return ty.startswith("tensor<")


def load(b: Body, view, offsets: list[str], sizes: list, ty: str) -> str:
    name, dty, ds = view
    return b.let(f"iree_tensor_ext.dispatch.tensor.load {name}, offsets = [{', '.join(offsets)}], sizes = "
                 f"[{', '.join(map(str, sizes))}], strides = [{', '.join(['1'] * len(sizes))}] : {dty}{{{', '.join(ds)}}} "
                 f"-> {ty}")


def store(b: Body, value: str, ty: str, view, offsets: list[str], sizes: list):
    name, dty, ds = view
    b.fn.emit(f"iree_tensor_ext.dispatch.tensor.store {value}, {name}, offsets = [{', '.join(offsets)}], sizes = "
              f"[{', '.join(map(str, sizes))}], strides = [{', '.join(['1'] * len(sizes))}] : {ty} -> "
              f"{dty}{{{', '.join(ds)}}}")
