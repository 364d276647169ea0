"""The CPU's group-mode entry point ``waves_varlen``: every sequence's row tiles (slots) advance
together, one key chunk each per step, so a call is a few large dispatches whatever the number
of sequences (``mlir/unit_waves.mlir.in``; its tables: ``plan.wave_tables``).
"""

from __future__ import annotations

from typing import Any, Mapping

from .lowering import _load, checked_fields, render_lowering_attrs
from .scores import score_region
from .step import _TO_F32, _cpu_config
from .unit_loop import _FROM_F32, LOOP_AFFINITY

__all__ = ["render_unit_waves"]


def render_unit_waves(*, func_name: str, dtype: str, group: int, r: int, c: int, dq: int, dv: int,
                      lowering: Mapping[str, Any], layout: str = "bshd", softcap: float = 0.0) -> str:
    """MLIR text of ``util.func public @func_name(q, k, v, chunks, slots, steps, rowslot, levels,
    scale: f32) -> (out, lse)``: sequences of packed tokens (``layout`` bshd ``[B, S, H, D]``, group
    mode's ``[1, T, H, D]``, or bhsd ``[B, H, S, D]``; token t = b S + s) in slots of ``r`` rows and
    key chunks of ``c``, each step one masked ``online_attention`` over the running slots carrying
    the CPU ``lowering`` (``tiles.CPU_STEP_LOWERING``)."""
    t = checked_fields(dtype, layout, group=group, r=r, c=c, c_narrow=c, dq=dq, dv=dv)
    st = "i16" if t == "bf16" else t
    props, attrs = render_lowering_attrs(dict(lowering), m_total=int(r), dv=int(dv), c=int(c), batch_dims=2)
    return _load("unit_waves.mlir.in").substitute(
        func_name=func_name, ST=st, G=int(group), R=int(r), C=int(c), DQ=int(dq), DV=int(dv),
        raw_to_f32=_TO_F32[st], f32_to_out=_FROM_F32[st], attn_props=props, attn_attrs=attrs,
        score_body=score_region(softcap), loop_affinity=LOOP_AFFINITY, iota_r=_iota(r), iota_c=_iota(c), iota_dq=_iota(dq), iota_dv=_iota(dv),
        **_COPY_CONFIGS, **_layout_fields(layout, st, int(group), int(dq), int(dv)))


def _layout_fields(layout: str, st: str, g: int, dq: int, dv: int) -> dict:
    """The template's layout-dependent text: dims, Q's per-(KV head, g) view and its indices (``%b``,
    ``%s``, ``%h``, ``%g``, ``%d`` in the copies), K's map, the output's view."""
    if layout == "bhsd":
        return dict(layout=layout, seq_dim=2, head_dim=1, q_doc="[B, Hq, S, Dq]", k_doc="[B, Hk, S, Dq]",
                    v_doc="[B, Hk, S, Dv]", q_expand="[0], [1, 2], [3], [4]", q5_shape=f"%B, %Hk, {g}, %Sq, {dq}",
                    q5_type=f"tensor<?x?x{g}x?x{dq}x{st}>", q5_index="%b, %h, %g, %s, %d", k_index="%b, %h, %s, %d",
                    v_index="%b, %h, %s, %d", out_empty="%B, %Hk, %Sq", out5_type=f"tensor<?x?x{g}x?x{dv}x{st}>",
                    out_map="b, h, g, s, d", out_collapse="[0], [1, 2], [3], [4]")
    return dict(layout=layout, seq_dim=1, head_dim=2, q_doc="[B, S, Hq, Dq]", k_doc="[B, S, Hk, Dq]",
                v_doc="[B, S, Hk, Dv]", q_expand="[0], [1], [2, 3], [4]", q5_shape=f"%B, %Sq, %Hk, {g}, {dq}",
                q5_type=f"tensor<?x?x?x{g}x{dq}x{st}>", q5_index="%b, %s, %h, %g, %d", k_index="%b, %s, %h, %d",
                v_index="%b, %s, %h, %d", out_empty="%B, %Sq, %Hk", out5_type=f"tensor<?x?x?x{g}x{dv}x{st}>",
                out_map="b, s, h, g, d", out_collapse="[0], [1], [2, 3], [4]")


def _iota(n: int) -> str:
    return ", ".join(map(str, range(int(n))))


# The copies: workgroups of 64 rows of Q / 16 head-dim rows of K^T / 64 keys of V / 16 output rows,
# vectors of 16 f32 along the last dim (a K^T chunk's keys, read from K with a stride; the head dims).
# K^T's chunks read from K directly: fewer copies than a transposed copy of K first, measured
# faster on the dev CPU (docs/tried.md, "`waves_varlen`'s K copies").
# IREE collapses that copy's (h, d) dims (no input is indexed by d alone) and then tiles it its own
# way; with the config kept (an input read by d) it ran the same, as did vectors along the head dim
# or 16 x 16 tiles (docs/tried.md, CPU).
_COPY_CONFIGS = {"q_config": _cpu_config([1, 1, 64, 0], [1, 1, 1, 16]),
                 "k_config": _cpu_config([1, 1, 16, 0], [1, 1, 1, 16]),
                 "v_config": _cpu_config([1, 1, 64, 0], [1, 1, 1, 16]),
                 "out_config": _cpu_config([1, 16, 0, 0, 0], [1, 1, 1, 1, 16])}
