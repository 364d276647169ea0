"""The functions a CPU module adds to its torch graphs (``source.source_mlir``): the plan's ``step``
with CPU gathers and lowering and ``step_open``, ``units`` / ``waves_varlen`` (and in bshd
``units_varlen``), and in bshd ``rows_packed`` / ``rows_packed_pages``."""

from __future__ import annotations

from ..problem.spec import KernelSpec

__all__ = ["cpu_functions"]


def cpu_functions(spec: KernelSpec) -> list[str]:
    """The rendered MLIR functions of a CPU module beside its torch graphs."""
    return _cpu_step(spec) + _cpu_units(spec) + _cpu_packed(spec)


def _cpu_step(spec: KernelSpec) -> list[str]:
    """The plan's ``step`` of a CPU module and ``step_open`` (units that see every key of their
    chunk, no mask): ``mlir/online_step.mlir.in`` with the CPU gathers and lowering
    (``tiles.CPU_STEP_LOWERING``, keys in steps of kN0)."""
    from .mlir_templates import render_online_step

    t = spec.tiles
    kw = dict(dtype=spec.dtype, layout=spec.layout, group=spec.group, r=t.m0, c=t.kv_chunk, dq=spec.dq, dv=spec.dv,
              lowering=_cpu_step_lowering(spec), softcap=spec.softcap)
    return [render_online_step(func_name="step", **kw), render_online_step(func_name="step_open", masked=False, **kw)]


def _cpu_step_lowering(spec: KernelSpec, keys: int | None = None) -> dict:
    """The CPU lowering of the step's and the unit loops' attention op: ``tiles.CPU_STEP_LOWERING``
    with keys in steps of ``keys`` (kN0 by default), at most ``tiles.CPU_STEP_VECTOR`` elements per
    vector tile of Q K^T / P V (wider head dims take fewer keys; above it the module's vectors spill
    to the stack, which segfaulted at d256)."""
    from ..problem.tiles import CPU_STEP_LOWERING, CPU_STEP_VECTOR

    k2 = keys or spec.tiles.n0
    while k2 > 8 and CPU_STEP_LOWERING["vector_m"] * k2 * max(spec.dq, spec.dv) > CPU_STEP_VECTOR:
        k2 //= 2
    return {**CPU_STEP_LOWERING, "reduction_k2": k2}


def _cpu_units(spec: KernelSpec) -> list[str]:
    """``units``: a batch-mode problem in one call, the plan's units (kM0 rows x the kv chunk) as a
    loop inside the module (``mlir_templates.unit_loop``); ``waves_varlen`` (sequences of packed
    tokens, all tiles a step at a time: group mode's short and middling sequences, batches of
    middling lengths; ``mlir_templates.unit_waves``); bshd modules also get group mode's
    ``units_varlen`` (long sequences: each tile's steps looped; ``mlir_templates.unit_varlen``)."""
    from .mlir_templates.unit_loop import render_unit_loop
    from .mlir_templates.unit_waves import render_unit_waves
    from ..problem.tiles import CPU_WAVE_KEYS, CPU_WAVE_ROWS

    t = spec.tiles
    funcs = [render_unit_loop(func_name="units", dtype=spec.dtype, layout=spec.layout, group=spec.group, r=t.m0,
                              c=t.kv_chunk, c_narrow=t.n0, dq=spec.dq, dv=spec.dv, lowering=_cpu_step_lowering(spec),
                              softcap=spec.softcap),
             render_unit_waves(func_name="waves_varlen", dtype=spec.dtype, group=spec.group, r=CPU_WAVE_ROWS,
                               c=CPU_WAVE_KEYS, dq=spec.dq, dv=spec.dv, layout=spec.layout,
                               lowering=_cpu_step_lowering(spec, CPU_WAVE_KEYS), softcap=spec.softcap)]
    if spec.layout == "bshd":  # group mode's packed sequences
        from .mlir_templates.unit_varlen import render_unit_varlen
        from ..problem.tiles import varlen_rows

        funcs.append(render_unit_varlen(func_name="units_varlen", dtype=spec.dtype, group=spec.group, r=varlen_rows(t),
                                        c=t.kv_chunk, c_narrow=t.n0, dq=spec.dq, dv=spec.dv,
                                        lowering=_cpu_step_lowering(spec), softcap=spec.softcap))
    return funcs


def _cpu_packed(spec: KernelSpec) -> list[str]:
    """A CPU module in group mode's layout (bshd) also gets ``rows_packed`` and
    ``rows_packed_pages`` (short queries of packed sequences, K / V read in place from packed
    tensors or a paged cache; ``mlir_templates.rows_packed``)."""
    if spec.layout != "bshd":
        return []
    from .mlir_templates.rows_packed import render_rows_packed

    kw = dict(dtype=spec.dtype, group=spec.group, dq=spec.dq, dv=spec.dv, softcap=spec.softcap)
    return [render_rows_packed(func_name="rows_packed", **kw),
            render_rows_packed(func_name="rows_packed_pages", paged=True, **kw)]
