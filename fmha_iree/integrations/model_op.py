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

import hashlib
import math

from ..codegen.link import CPU_LOOP_ROWS, CPU_SHORT_ROWS, kernel_function, result_types
from ..codegen.wrappers import CallSite, VarlenSite, batch_wrapper, varlen_wrapper
from ..problem.mask import Mask
from ..problem.spec import KernelSpec
from ..problem.targets import Target
from ..problem.tiles import default_tiles

__all__ = ["OP_NAME", "VARLEN_OP_NAME", "Expander", "VarlenExpander", "expanders"]

OP_NAME = "fmha_iree.fmha_fwd"  # torch.ops.fmha_iree.fmha_fwd(q, k, v, mask, scale, layout) -> (out, lse)
# torch.ops.fmha_iree.fmha_fwd_varlen(q, k, v, seqstart_q, <VARLEN_TABLES>, mask, scale) -> (out, lse)
VARLEN_OP_NAME = "fmha_iree.fmha_fwd_varlen"
VARLEN_TABLES = ("seqstart_k", "seqlen_k", "seqstart_padded_q", "seqstart_padded_k", "block_table")
_DTYPES = ("f16", "bf16", "f32")


class _Expansion:
    """What both expanders share: the target, the kernels rendered so far in this export (one
    text per kernel name, shared by the expanders of one :func:`expanders` registry) and the
    merge of a kernel and a wrapper into the model."""

    def __init__(self, target: Target, kernels: dict[str, str]):
        self.target = target
        self._kernels = kernels  # kernel name -> its rendered text, once per export

    def _call(self, kb, spec: KernelSpec, short: bool, site, args: list, wrapper_text,
              rows: int | None = None) -> None:
        """Merge the kernel for ``spec`` (``short``: with the CPU's short tiles; ``rows``: the
        CPU's rows per tile, else the spec's) and a wrapper for
        ``site`` and the operand types of ``args`` (``wrapper_text(kernel, wrapper, arg_types,
        kernel_results)``), unless merged already; then call the wrapper on ``args`` and yield its
        (out, lse)."""
        from iree.turbine.runtime.op_reg.impl_helper import call_function
        from iree.turbine.support.ir_imports import Operation

        kernel = "fmha_iree_" + spec.module_name + ("_short" if short else f"_r{rows}" if rows else "")
        arg_types = tuple(str(a.type) for a in args)
        wrapper = f"{kernel}_call_{_digest((site, arg_types))}"
        if not _has(kb.symbol_table, wrapper):
            if kernel not in self._kernels:
                self._kernels[kernel] = kernel_function(spec, kernel, short=short, rows=rows)
            kernel_text = self._kernels[kernel]
            text = kernel_text + wrapper_text(kernel, wrapper, arg_types, result_types(kernel_text, kernel))
            source = Operation.parse(f"module {{\n{text}\n}}", context=kb.context)
            if _has(kb.symbol_table, kernel):  # merged by an earlier call site: the wrapper alone
                _drop(source, kernel)
            _merge(kb, source)
        out, lse = call_function(kb.symbol_table[wrapper], *args)
        kb.yield_results(out, lse)


class Expander(_Expansion):
    """The expansion of ``torch.ops.fmha_iree.fmha_fwd`` (batch mode) for one target: turbine's
    ``ExpandCustomOpsPass`` calls :meth:`select` and :meth:`generate` for each call it finds."""

    name = OP_NAME

    def select(self, ksel) -> None:
        import torch

        for i in range(3):
            ksel.arg_tensor(i)
        mask = ksel.attr_str(3)
        scale = _optional_float(ksel, 4)
        layout = ksel.attr_str(5)
        self._softcap = _softcap(ksel, 6)
        for i, name in ((7, "bias: an elementwise bias"), (8, "alibi_slopes: ALiBi")):
            if len(ksel.operands) > i and ksel.arg_optional_tensor(i) is not None:
                raise ValueError(f"{name} is not taken inside exported models yet (the model's kernel is "
                                 "fmha_iree's general function, which reads none); run the model eagerly or under "
                                 "torch.compile")
        q, _, v = (ksel.arg_descs[i].t for i in range(3))
        site = _call_site(ksel, mask.v, scale, layout.v)
        b, s_ax, h_ax = q.shape[0], (2 if site.layout == "bhsd" else 1), (1 if site.layout == "bhsd" else 2)
        out = torch.empty(list(q.shape[:3]) + [v.shape[3]], dtype=q.dtype)
        ksel.return_tensor(out)
        ksel.return_tensor(torch.empty([b, q.shape[h_ax], q.shape[s_ax]], dtype=torch.float32))
        self._site = site

    def generate(self, ksel, kb) -> None:
        site = self._site
        hq, hk = site.heads
        spec = _kernel_spec(site.dtype, site.layout, hq, hk, site.shape_q[3], site.shape_v[3], self.target,
                            self._softcap)
        backend = spec.target.backend

        def text(kernel, wrapper, arg_types, results):
            return batch_wrapper(site, backend, kernel, wrapper, arg_types, results)

        self._call(kb, spec, _short(site, spec), site, [kb.arg_value(i) for i in range(3)], text)


class VarlenExpander(_Expansion):
    """The expansion of ``torch.ops.fmha_iree.fmha_fwd_varlen`` (group mode, a paged cache) for
    one target: a loop over the sequences calling the kernel once per sequence
    (``codegen.wrappers.varlen_wrapper``)."""

    name = VARLEN_OP_NAME

    def select(self, ksel) -> None:
        import torch

        for i in range(4):
            ksel.arg_tensor(i)
        given = tuple(n for i, n in enumerate(VARLEN_TABLES, 4) if ksel.arg_optional_tensor(i) is not None)
        mask = ksel.attr_str(9)
        scale = _optional_float(ksel, 10)
        self._softcap = _softcap(ksel, 11)
        self._site = site = _varlen_site(ksel, given, mask.v, scale)
        q = ksel.arg_descs[0].t
        ksel.return_tensor(torch.empty([q.shape[0], site.hq, site.dv], dtype=q.dtype))
        ksel.return_tensor(torch.empty([site.hq, ksel.shape_env.create_unbacked_symint()], dtype=torch.float32))

    def generate(self, ksel, kb) -> None:
        site = self._site
        spec = _kernel_spec(site.dtype, "bshd", site.hq, site.hk, site.dq, site.dv, self.target, self._softcap)
        backend = spec.target.backend
        names = ("q", "k", "v", "seqstart_q", *site.given)

        def text(kernel, wrapper, arg_types, results):
            return varlen_wrapper(site, backend, kernel, wrapper, dict(zip(names, arg_types)), results)

        args = [a for a in kb.arg_bindings if a is not None]  # the tensors given (mask, scale are attributes)
        # one kernel, on the CPU of CPU_LOOP_ROWS rows per tile (decode and prefill sequences
        # alike): with the short-tile form beside it behind a per-sequence scf.if, the module's
        # initializer asked for more memory than the host has (docs/model-export.md)
        rows = CPU_LOOP_ROWS if backend == "llvm-cpu" else None
        self._call(kb, spec, False, site, args, text, rows=rows)


def expanders(target: str | Target) -> dict:
    """The registry ``ExpandCustomOpsPass`` takes: fmha_iree's op names -> their expanders (one
    kernel text per kernel name shared between them)."""
    t = target if isinstance(target, Target) else Target.from_name(target)
    kernels: dict[str, str] = {}
    return {OP_NAME: Expander(t, kernels), VARLEN_OP_NAME: VarlenExpander(t, kernels)}


def _optional_float(ksel, i: int):
    """A ``float | None`` constant argument (turbine's ``attr_float`` takes floats only)."""
    from iree.turbine.runtime.op_reg.base import AttrArg

    if str(ksel.operands[i].type) == "!torch.none":
        ksel.arg_descs[i] = desc = AttrArg(None)
        return desc.v
    return ksel.attr_float(i).v


def _operand_types(ksel, n: int) -> list:
    """The first ``n`` operands' builtin tensor types."""
    from iree.turbine.support.ir_imports import RankedTensorType

    return [RankedTensorType(ksel.type_converter.torch_type_to_native(ksel.operands[i].type, signless=False))
            for i in range(n)]


def _shape(t) -> tuple:
    return tuple(-1 if t.is_dynamic_dim(d) else t.get_dim_size(d) for d in range(t.rank))


def _check_dtypes(types) -> str:
    dtype = str(types[0].element_type)
    if dtype not in _DTYPES or any(str(t.element_type) != dtype for t in types):
        raise TypeError(f"q, k and v must share one of dtypes f16, bf16, f32; got "
                        f"{[str(t.element_type) for t in types]}")
    return dtype


def _check_heads(hq: int, hk: int) -> None:
    if hq < 0 or hk < 0 or hk == 0 or hq % hk:
        raise ValueError(f"the heads of q and k must be static with Hq a multiple of Hk, got Hq {hq}, Hk {hk}")


def site_mask(mask: str) -> Mask:
    """A call site's mask: a window (sink tokens are added by the eager wrappers, outside the
    kernel, which an exported model does not run: refused at export rather than dropped)."""
    m = Mask.from_str(mask)
    if m.sink:
        raise ValueError(f"mask {mask!r}: sink tokens are not supported inside an exported model yet (the kernel "
                         "applies windows; fmha_iree's eager calls add the sink keys to its results)")
    return m


def _call_site(ksel, mask: str, scale, layout: str) -> CallSite:
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    types = _operand_types(ksel, 3)
    dtype = _check_dtypes(types)
    shapes = [_shape(t) for t in types]
    if any(len(s) != 4 for s in shapes):
        raise ValueError(f"q, k and v must be rank-4 ({layout}), got shapes {shapes}")
    dq = shapes[0][3]
    if dq < 0 or shapes[1][3] != dq or shapes[2][3] < 0:
        raise ValueError(f"head dims must be static and q's equal k's, got q {shapes[0]}, k {shapes[1]}, v {shapes[2]}")
    s = 1.0 / math.sqrt(dq) if scale is None else float(scale)
    site = CallSite(dtype, layout, *shapes, site_mask(mask), s)
    _check_heads(*site.heads)
    return site


def _varlen_site(ksel, given: tuple[str, ...], mask: str, scale) -> VarlenSite:
    """The group-mode call's facts, or the ValueError / TypeError naming what the call gets wrong."""
    types = _operand_types(ksel, 4)
    dtype = _check_dtypes(types[:3])
    q, k, v = (_shape(t) for t in types[:3])
    paged = "block_table" in given
    rank = 4 if paged else 3
    if len(q) != 3 or len(k) != rank or len(v) != rank:
        raise ValueError(f"fmha_fwd_varlen takes q [Tq, Hq, Dq] and k, v [Tk, Hk, D] (paged: [pages, page_size, Hk, "
                         f"D]), got q {list(q)}, k {list(k)}, v {list(v)}")
    if paged and ({"seqstart_k", "seqstart_padded_k"} & set(given) or "seqlen_k" not in given):
        raise ValueError("block_table: a paged cache takes seqlen_k (each sequence's keys) and no seqstart_k / "
                         "seqstart_padded_k")
    if not paged and "seqstart_k" not in given:
        raise ValueError("seqstart_k is required unless block_table is given")
    if str(types[3].element_type) not in ("i32", "si32") or types[3].rank != 1:
        raise TypeError(f"seqstart_q must be a 1-D int32 tensor, got {types[3]}")
    dq, dv = q[2], v[-1]
    if dq < 0 or k[-1] != dq or dv < 0:
        raise ValueError(f"head dims must be static and q's equal k's, got q {list(q)}, k {list(k)}, v {list(v)}")
    _check_heads(q[1], k[-2])
    s = 1.0 / math.sqrt(dq) if scale is None else float(scale)
    return VarlenSite(dtype, q[1], k[-2], dq, dv, given, site_mask(mask), s)


def _softcap(ksel, i: int) -> float:
    """The op's ``softcap`` argument (operand ``i``; absent or None: 0.0, no cap)."""
    if len(ksel.operands) <= i:
        return 0.0
    from ..problem.spec import check_softcap

    return check_softcap(_optional_float(ksel, i))


def _kernel_spec(dtype: str, layout: str, hq: int, hk: int, dq: int, dv: int, target: Target,
                 softcap: float = 0.0) -> KernelSpec:
    tiles = default_tiles(target.family, dq, dv, arch=target.arch, dtype=dtype)
    return KernelSpec(dtype, layout, hq // hk, dq, dv, tiles, target, softcap=softcap)


def _short(site: CallSite, spec: KernelSpec) -> bool:
    """Whether the call site's queries are known short (a static Sq with at most
    ``CPU_SHORT_ROWS`` query rows per KV head, a decode step): on the CPU its kernel then takes
    tiles of that many rows. Chosen at export, not at run time: with both kernels behind a
    runtime branch an f16 bhsd model crashed (docs/BENCHMARKS.md)."""
    sq = site.shape_q[2 if site.layout == "bhsd" else 1]
    return spec.target.backend == "llvm-cpu" and 0 < sq and sq * spec.group <= CPU_SHORT_ROWS


def _digest(key) -> str:
    return hashlib.sha256(repr(key).encode()).hexdigest()[:10]


def _has(table, name: str) -> bool:
    try:
        table[name]
    except KeyError:
        return False
    return True


def _drop(module, name: str) -> None:
    """Erase the symbol ``name`` from ``module`` (parsed text)."""
    from iree.turbine.support.ir_imports import SymbolTable

    SymbolTable(module.operation)[name].erase()


def _merge(kb, source_module) -> None:
    from iree.turbine.transforms.merger import Merger

    Merger(source_module, kb.module_body.owner, target_symbol_table=kb.symbol_table).merge()
