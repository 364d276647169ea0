"""fmha_iree's attention inside an exported model: ``torch.ops.fmha_iree.fmha_fwd`` expanded, at
export time, into a call of fmha_iree's kernel function merged into the model's module.

A model calls the torch op (``fmha_iree.sdpa``, the transformers backend and
``torch.ops.fmha_iree.fmha_fwd`` all do); ``iree.turbine.aot.export`` imports the call as a
``torch.operator``; turbine's ``ExpandCustomOpsPass`` with :func:`expanders` replaces each such
call with a ``util.call`` of a wrapper that hides the call site's sizes from the kernel, computes
CK's mask coordinates ``(y, x)`` from the runtime lengths and calls the kernel: ``units`` on the
CPU (``codegen.mlir_templates.unit_loop``), ``fwd`` on GPU targets (``codegen.kernels.general``),
the same functions fmha_iree's own modules export, with the same ``(q, k, v, scale, y, x)`` ABI.
The kernel is merged once per specialization (dtype, layout, G, head dims, target) and shared by
every layer; a wrapper once per call-site signature.

The wrapper passes q, k, v, their sizes and the scale through ``util.optimization_barrier``s, so
that the kernel is compiled as in fmha_iree's own modules, every size and the scale a runtime
value: with a static ``B * Hk = 1`` and ``G > 1`` at the call site IREE 3.13 miscompiled the
inlined CPU kernel (docs/model-export.md, "The unit-batch miscompile"), and with a constant scale
it hoisted the GPU kernel's work into an initializer the VM conversion refused. On GPU targets the
kernel is not inlined (``#util.inline.never``): two inlined copies of ``fwd`` in one function
failed to compile for sm_80 (docs/model-export.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

from ..codegen.link import CPU_SHORT_ROWS, kernel_function, result_types
from ..problem.mask import Mask
from ..problem.spec import KernelSpec
from ..problem.targets import Target
from ..problem.tiles import default_tiles

__all__ = ["OP_NAME", "Expander", "expanders", "coords_linear"]

OP_NAME = "fmha_iree.fmha_fwd"  # torch.ops.fmha_iree.fmha_fwd(q, k, v, mask, scale, layout) -> (out, lse)
_DTYPES = ("f16", "bf16", "f32")


@dataclasses.dataclass(frozen=True)
class CallSite:
    """One expanded call: what the torch op's constant arguments and operand types say."""

    dtype: str
    layout: str
    shape_q: tuple  # static sizes, -1 for dynamic ones
    shape_k: tuple
    shape_v: tuple
    mask: Mask
    scale: float

    @property
    def heads(self) -> tuple[int, int]:
        h = 1 if self.layout == "bhsd" else 2
        return self.shape_q[h], self.shape_k[h]


def coords_linear(mask: Mask) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """``(y, x)`` of ``mask`` as ``a + b * Sq + c * Sk`` each (``Mask.coords`` is linear in the
    lengths): ``((a, b, c) of y, (a, b, c) of x)``."""
    y0, x0 = mask.coords(0, 0)
    yq, xq = mask.coords(1, 0)
    yk, xk = mask.coords(0, 1)
    return (y0, yq - y0, yk - y0), (x0, xq - x0, xk - x0)


class Expander:
    """The expansion of ``torch.ops.fmha_iree.fmha_fwd`` for one target: turbine's
    ``ExpandCustomOpsPass`` calls :meth:`select` and :meth:`generate` for each call it finds."""

    name = OP_NAME

    def __init__(self, target: Target):
        self.target = target
        self._kernels: dict[str, str] = {}  # kernel name -> its rendered text, once per export

    def select(self, ksel) -> None:
        import torch

        for i in range(3):
            ksel.arg_tensor(i)
        mask = ksel.attr_str(3)
        scale = _optional_float(ksel, 4)
        layout = ksel.attr_str(5)
        q, _, v = (ksel.arg_descs[i].t for i in range(3))
        site = _call_site(ksel, mask.v, scale, layout.v)
        b, s_ax, h_ax = q.shape[0], (2 if site.layout == "bhsd" else 1), (1 if site.layout == "bhsd" else 2)
        out = torch.empty(list(q.shape[:3]) + [v.shape[3]], dtype=q.dtype)
        ksel.return_tensor(out)
        ksel.return_tensor(torch.empty([b, q.shape[h_ax], q.shape[s_ax]], dtype=torch.float32))
        self._site = site

    def generate(self, ksel, kb) -> None:
        from iree.turbine.runtime.op_reg.impl_helper import call_function
        from iree.turbine.support.ir_imports import Operation

        site = self._site
        spec = _kernel_spec(site, self.target)
        short = _short(site, spec)
        kernel = "fmha_iree_" + spec.module_name + ("_short" if short else "")
        args = [kb.arg_value(i) for i in range(3)]
        arg_types = tuple(str(a.type) for a in args)
        wrapper = f"{kernel}_call_{_digest((site, arg_types))}"
        if not _has(kb.symbol_table, wrapper):
            if kernel not in self._kernels:
                self._kernels[kernel] = kernel_function(spec, kernel, short=short)
            kernel_text = self._kernels[kernel]
            text = kernel_text + _wrapper_text(site, spec, kernel, wrapper, arg_types,
                                               result_types(kernel_text, kernel))
            source = Operation.parse(f"module {{\n{text}\n}}", context=kb.context)
            if _has(kb.symbol_table, kernel):  # merged by an earlier call site: the wrapper alone
                _drop(source, kernel)
            _merge(kb, source)
        out, lse = call_function(kb.symbol_table[wrapper], *args)
        kb.yield_results(out, lse)


def expanders(target: str | Target) -> dict:
    """The registry ``ExpandCustomOpsPass`` takes: fmha_iree's op name -> its expander."""
    t = target if isinstance(target, Target) else Target.from_name(target)
    return {OP_NAME: Expander(t)}


def _optional_float(ksel, i: int):
    """A ``float | None`` constant argument (turbine's ``attr_float`` takes floats only)."""
    from iree.turbine.runtime.op_reg.base import AttrArg

    if str(ksel.operands[i].type) == "!torch.none":
        ksel.arg_descs[i] = desc = AttrArg(None)
        return desc.v
    return ksel.attr_float(i).v


def _call_site(ksel, mask: str, scale, layout: str) -> CallSite:
    from iree.turbine.support.ir_imports import RankedTensorType

    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    types = []
    for i in range(3):
        native = ksel.type_converter.torch_type_to_native(ksel.operands[i].type, signless=False)
        types.append(RankedTensorType(native))
    dtype = str(types[0].element_type)
    if dtype not in _DTYPES or any(str(t.element_type) != dtype for t in types):
        raise TypeError(f"q, k and v must share one of dtypes f16, bf16, f32; got "
                        f"{[str(t.element_type) for t in types]}")
    shapes = [tuple(-1 if t.is_dynamic_dim(d) else t.get_dim_size(d) for d in range(t.rank)) for t in types]
    if any(len(s) != 4 for s in shapes):
        raise ValueError(f"q, k and v must be rank-4 ({layout}), got shapes {shapes}")
    dq = shapes[0][3]
    if dq < 0 or shapes[1][3] != dq or shapes[2][3] < 0:
        raise ValueError(f"head dims must be static and q's equal k's, got q {shapes[0]}, k {shapes[1]}, v {shapes[2]}")
    s = 1.0 / math.sqrt(dq) if scale is None else float(scale)
    site = CallSite(dtype, layout, *shapes, Mask.from_str(mask), s)
    hq, hk = site.heads
    if hq < 0 or hk < 0 or hk == 0 or hq % hk:
        raise ValueError(f"the heads of q and k must be static with Hq a multiple of Hk, got Hq {hq}, Hk {hk}")
    return site


def _kernel_spec(site: CallSite, target: Target) -> KernelSpec:
    hq, hk = site.heads
    dq, dv = site.shape_q[3], site.shape_v[3]
    tiles = default_tiles(target.family, dq, dv, arch=target.arch, dtype=site.dtype)
    return KernelSpec(site.dtype, site.layout, hq // hk, dq, dv, tiles, target)


def _short(site: CallSite, spec: KernelSpec) -> bool:
    """Whether the call site's queries are known short (a static Sq with at most
    ``CPU_SHORT_ROWS`` query rows per KV head, a decode step): on the CPU its kernel then takes
    tiles of that many rows. Chosen at export, not at run time: with both kernels behind a
    runtime branch an f16 bhsd model crashed (docs/BENCHMARKS.md)."""
    sq = site.shape_q[2 if site.layout == "bhsd" else 1]
    return spec.target.backend == "llvm-cpu" and 0 < sq and sq * spec.group <= CPU_SHORT_ROWS


def _digest(key) -> str:
    return hashlib.sha256(repr(key).encode()).hexdigest()[:10]


def _tensor(shape, dtype: str) -> str:
    return "tensor<" + "x".join("?" if d < 0 else str(d) for d in shape) + f"x{dtype}>"


def _has(table, name: str) -> bool:
    try:
        table[name]
    except KeyError:
        return False
    return True


def _wrapper_text(site: CallSite, spec: KernelSpec, kernel: str, wrapper: str, arg_types: tuple[str, ...],
                  kernel_results: list[str]) -> str:
    """``util.func private @wrapper(q, k, v) -> (out, lse)`` over the call's operand types
    ``arg_types``: q, k and v re-tied to their sizes passed through a barrier (so that the kernel
    is compiled with every size dynamic), the kernel's storage types (bf16 as i16 bits on
    the CPU), CK's (y, x) from the runtime lengths, clipped as ``Mask.clipped_coords`` does; the
    kernel's out and lse returned with its own (dynamic) types."""
    T = site.dtype
    st = "i16" if T == "bf16" and spec.target.backend == "llvm-cpu" else T
    dq, dv = site.shape_q[3], site.shape_v[3]
    s_ax = 2 if site.layout == "bhsd" else 1
    tq, tk, tv = arg_types
    dq_t, dv_t = _tensor((-1, -1, -1, dq), st), _tensor((-1, -1, -1, dv), st)
    k_out, k_lse, n_results = kernel_results[0], kernel_results[1], len(kernel_results)
    tout = k_out.replace("i16", "bf16") if st != T else k_out
    (ya, yq, yk), (xa, xq, xk) = coords_linear(site.mask)
    lines = [f"util.func private @{wrapper}(%q: {tq}, %k: {tk}, %v: {tv}) -> ({tout}, {k_lse}) {{"]
    for n, t in (("q", tq), ("k", tk), ("v", tv)):
        src = f"%{n}"
        if st != T:
            src = _bitcast(lines, n, src, t, t.replace("bf16", "i16"))
            t = t.replace("bf16", "i16")
        lines.append(f"  %{n}d = tensor.cast {src} : {t} to {dv_t if n == 'v' else dq_t}")
    lines += [f"  %c{i} = arith.constant {i} : index" for i in range(3)]
    for n, t in (("q", dq_t), ("k", dq_t), ("v", dv_t)):
        lines += [f"  %{n}s{i} = tensor.dim %{n}d, %c{i} : {t}" for i in range(3)]
    sizes = [f"%{n}s{i}" for n in "qkv" for i in range(3)]
    lines.append(f"  {', '.join(s.replace('s', 'h', 1) for s in sizes)} = util.optimization_barrier "
                 f"{', '.join(sizes)} : {', '.join(['index'] * 9)}")
    for n, t in (("q", dq_t), ("k", dq_t), ("v", dv_t)):
        hidden = ", ".join(f"%{n}h{i}" for i in range(3))
        lines.append(f"  %{n}o = util.optimization_barrier %{n}d : {t}")
        lines.append(f"  %{n}b = flow.tensor.tie_shape %{n}o : {t}{{{hidden}}}")
    lines += [f"  %sq = arith.addi %qh{s_ax}, %c0 : index",
              f"  %sk = arith.addi %kh{s_ax}, %c0 : index",
              *_linear("y", ya, yq, yk), *_linear("x", xa, xq, xk),
              # clipped: y in [-Sk, Sq + 1], x in [-Sq, Sk + 1]
              "  %nsk = arith.subi %c0, %sk : index", "  %nsq = arith.subi %c0, %sq : index",
              "  %sq1 = arith.addi %sq, %c1 : index", "  %sk1 = arith.addi %sk, %c1 : index",
              "  %y1 = arith.maxsi %y0, %nsk : index", "  %y2 = arith.minsi %y1, %sq1 : index",
              "  %x1 = arith.maxsi %x0, %nsq : index", "  %x2 = arith.minsi %x1, %sk1 : index",
              "  %y = arith.index_cast %y2 : index to i64", "  %x = arith.index_cast %x2 : index to i64",
              # the scale a runtime value to the kernel too, as in fmha_iree's own modules (a
              # constant scale let IREE hoist the kernel's scaled work into an initializer the VM
              # conversion refused, sm_80)
              f"  %scale0 = arith.constant {float(site.scale)!r} : f32",
              "  %scale = util.optimization_barrier %scale0 : f32",
              f"  %r:{n_results} = util.call @{kernel}(%qb, %kb, %vb, %scale, %y, %x) : "
              f"({dq_t}, {dq_t}, {dv_t}, f32, i64, i64) -> ({', '.join(kernel_results)})"]
    o = _bitcast(lines, "o", "%r#0", k_out, tout) if st != T else "%r#0"
    lines += [f"  util.return {o}, %r#1 : {tout}, {k_lse}", "}"]
    return "\n".join(lines) + "\n"


def _bitcast(lines: list, n: str, src: str, t_from: str, t_to: str) -> str:
    lines.append(f"  %{n}i = arith.bitcast {src} : {t_from} to {t_to}")
    return f"%{n}i"


def _linear(name: str, a: int, b: int, c: int) -> list[str]:
    """``%<name>0 = a + b * sq + c * sk`` (index)."""
    return [f"  %{name}a = arith.constant {a} : index", f"  %{name}b = arith.constant {b} : index",
            f"  %{name}c = arith.constant {c} : index",
            f"  %{name}q = arith.muli %{name}b, %sq : index", f"  %{name}k = arith.muli %{name}c, %sk : index",
            f"  %{name}s = arith.addi %{name}a, %{name}q : index", f"  %{name}0 = arith.addi %{name}s, %{name}k : index"]


def _drop(module, name: str) -> None:
    """Erase the symbol ``name`` from ``module`` (parsed text)."""
    from iree.turbine.support.ir_imports import SymbolTable

    SymbolTable(module.operation)[name].erase()


def _merge(kb, source_module) -> None:
    from iree.turbine.transforms.merger import Merger

    Merger(source_module, kb.module_body.owner, target_symbol_table=kb.symbol_table).merge()
