"""A module's general attention function on its own, for other modules to call: a model exported
with fmha_iree's attention inside (``integrations.model_op``) and modules linked with ``iree-link``
(``fmha-iree link-module``). ``units`` on the CPU (``mlir_templates.unit_loop``), ``fwd`` on GPU
targets (``kernels.general``): fmha_iree's own modules export the same functions, with the ABI
``(q, k, v, scale: f32, y: i64, x: i64) -> (out, lse[, scratch...])`` (docs/architecture.md)."""

from __future__ import annotations

from ..problem.spec import KernelSpec

__all__ = ["CPU_SHORT_ROWS", "CPU_LOOP_ROWS", "kernel_function", "link_module", "declaration", "result_types",
           "never_inlined"]


# CPU: the unit loop's rows per tile for call sites whose queries are known short (a decode step:
# at most this many query rows per KV head): a one-row decode padded to the module's 256-row tiles
# took 79 ms at Sk = 4096 against 1.4 ms with 8-row tiles (docs/BENCHMARKS.md, "fmha_iree inside an
# exported model").
CPU_SHORT_ROWS = 8

# CPU: the rows per tile of the kernel a group-mode call site loops over its sequences with (their
# lengths unknown at export): against the module's 256-row tiles, 128 rows ran decode 1.4-2.0x
# faster and prefill from 18% slower to 17% faster, by head dim and group (docs/BENCHMARKS.md,
# "fmha_iree inside an exported model", the CPU's group mode).
CPU_LOOP_ROWS = 128


def kernel_function(spec: KernelSpec, name: str, *, public: bool = False, short: bool = False,
                    rows: int | None = None) -> str:
    """The MLIR text of the attention function for ``spec``, named ``name`` (private unless
    ``public``); on the CPU tiles of ``CPU_SHORT_ROWS`` rows where ``short``, else of ``rows``
    (default: the spec's kM0). On GPU targets it is marked
    never to be inlined: two inlined copies of ``fwd`` in one function failed to compile for sm_80
    (docs/model-export.md)."""
    from .source import fwd_plan

    if spec.target.backend == "llvm-cpu":
        from .mlir_templates.unit_loop import render_unit_loop
        from .source_cpu import _cpu_step_lowering

        t, low = spec.tiles, _cpu_step_lowering(spec)
        rows = CPU_SHORT_ROWS if short else rows or t.m0
        low = {**low, "workgroup_m": min(int(low["workgroup_m"]), rows)}
        text = render_unit_loop(func_name=name, dtype=spec.dtype, layout=spec.layout, group=spec.group, r=rows,
                                c=t.kv_chunk, c_narrow=t.n0, dq=spec.dq, dv=spec.dv, lowering=low,
                                softcap=spec.softcap)
    else:
        from .kernels.general import render_fwd

        plan = fwd_plan(spec, fused_step=True)
        if plan is None:
            raise ValueError(f"dtype {spec.dtype!r} with head dims {spec.dq}/{spec.dv} has no fwd kernel for target "
                             f"{spec.target.arch} (fmha_iree's GPU modules carry fwd in f16 / bf16)")
        text = render_fwd(plan, name)
    if not public:
        text = text.replace(f"util.func public @{name}", f"util.func private @{name}", 1)
    if spec.target.backend != "llvm-cpu":
        text = never_inlined(text, name)
    return text


def never_inlined(text: str, name: str) -> str:
    """``text`` with function ``name`` marked never to be inlined."""
    head = text.index(f"@{name}(")
    body = text.index("{\n", head)
    return text[:body] + "attributes {inlining_policy = #util.inline.never} " + text[body:]


def result_types(text: str, name: str) -> list[str]:
    """The result types of function ``name`` in its rendered ``text``: out, lse, then ``fwd``'s
    scratch."""
    head = text[text.index(f"@{name}("):]
    head = head[:head.index("{")]
    results, depth, cur = [], 0, ""
    for ch in head[head.index("-> (") + 4:head.rindex(")")]:
        depth += (ch == "<") - (ch == ">")
        if ch == "," and depth == 0:
            results.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return results + ([cur.strip()] if cur.strip() else [])


def declaration(text: str, name: str, callee: str) -> str:
    """``util.func private @callee(<argument types>) -> (<result types>)``: how another module
    declares the function ``name`` of ``text`` to call it."""
    import re

    head = text[text.index(f"@{name}("):]
    args = head[len(name) + 2:head.index("->")].rsplit(")", 1)[0]
    types = re.findall(r"%\w+: ([^,]+?(?:<[^>]*>)?)(?=,\s*%|\s*$)", args.strip())
    return f"util.func private @{callee}({', '.join(types)}) -> ({', '.join(result_types(text, name))})"


def link_module(spec: KernelSpec, module: str = "fmha_iree", name: str = "attention") -> str:
    """A module ``@module`` holding the public ``@name`` for ``spec``: with ``iree-link
    --link-module=<it>`` another module's declaration ``util.func private @module.name(...)``
    resolves to it."""
    return f"module @{module} {{\n{kernel_function(spec, name, public=True)}}}\n"
