"""The CPU's group-mode entry point ``waves_varlen``: every sequence's row tiles (slots) advance
together, one key chunk each per step, so a call is a few large dispatches whatever the number
of sequences (``mlir/unit_waves.mlir.in``; its tables: ``plan.wave_tables``).
"""

from __future__ import annotations

from typing import Any, Mapping

from .lowering import _load, checked_fields, render_lowering_attrs
from .step import _TO_F32, _cpu_config
from .unit_loop import _FROM_F32, LOOP_AFFINITY

__all__ = ["render_unit_waves"]


def render_unit_waves(*, func_name: str, dtype: str, group: int, r: int, c: int, dq: int, dv: int,
                      lowering: Mapping[str, Any]) -> str:
    """MLIR text of ``util.func public @func_name(q, k, v, chunks, slots, steps, rowslot, counts,
    scale: f32) -> (out, lse)``: packed sequences (bshd ``[1, T, H, D]``) in slots of ``r`` rows
    and key chunks of ``c``, each step one masked ``online_attention`` over the running slots
    carrying the CPU ``lowering`` (``tiles.CPU_STEP_LOWERING``)."""
    t = checked_fields(dtype, "bshd", group=group, r=r, c=c, c_narrow=c, dq=dq, dv=dv)
    st = "i16" if t == "bf16" else t
    props, attrs = render_lowering_attrs(dict(lowering), m_total=int(r), dv=int(dv), c=int(c), batch_dims=2)
    return _load("unit_waves.mlir.in").substitute(
        func_name=func_name, ST=st, G=int(group), R=int(r), C=int(c), DQ=int(dq), DV=int(dv),
        raw_to_f32=_TO_F32[st], f32_to_out=_FROM_F32[st], attn_props=props, attn_attrs=attrs,
        loop_affinity=LOOP_AFFINITY, iota_r=_iota(r), iota_c=_iota(c), iota_dq=_iota(dq), iota_dv=_iota(dv),
        **_COPY_CONFIGS)


def _iota(n: int) -> str:
    return ", ".join(map(str, range(int(n))))


# The copies: workgroups of 64 rows of Q / 16 head-dim rows of K^T / 64 keys of V / 16 output rows,
# vectors of 16 f32 along the last dim (keys of K^T, read contiguously from K^T; the head dims).
_COPY_CONFIGS = {"q_config": _cpu_config([1, 1, 64, 0], [1, 1, 1, 16]),
                 "k_config": _cpu_config([1, 1, 16, 0], [1, 1, 1, 16]),
                 "v_config": _cpu_config([1, 1, 64, 0], [1, 1, 1, 16]),
                 "out_config": _cpu_config([1, 16, 0, 0, 0], [1, 1, 1, 1, 16])}
