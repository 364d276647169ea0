"""The CPU's batch-mode ``units`` entry point: the tile plan's units as a loop inside the module
(``mlir/unit_loop.mlir.in``), each unit one ``online_attention`` of static shape.
"""

from __future__ import annotations

from typing import Any, Mapping

from .lowering import _load, checked_fields, render_lowering_attrs
from .step import _TO_F32

__all__ = ["render_unit_loop"]

# An f32 (%ov) to the output's storage type (%res); a storage element (%raw) to f32 (%val) is
# the step's ``_TO_F32``.
_FROM_F32 = {"f32": "    %res = arith.addf %ov, %zero : f32",
             "f16": "    %res = arith.truncf %ov : f32 to f16",
             "i16": "    %rb = arith.truncf %ov : f32 to bf16\n    %res = arith.bitcast %rb : bf16 to i16"}


def render_unit_loop(*, func_name: str, dtype: str, layout: str, group: int, r: int, c: int, dq: int, dv: int,
                     lowering: Mapping[str, Any]) -> str:
    """MLIR text of ``util.func public @func_name(q, k, v, scale: f32, y: i64, x: i64) -> (out,
    lse)``: any batch-mode problem (runtime B, Sq, Sk, heads; CK's mask coordinates ``(y, x)``)
    as units of ``r`` rows x ``c`` keys in a loop inside the module, each unit's
    ``online_attention`` carrying the CPU ``lowering`` (``tiles.CPU_STEP_LOWERING``). bf16 is
    passed as its int16 bits, as the CPU's other entry points take it."""
    t = checked_fields(dtype, layout, group=group, r=r, c=c, dq=dq, dv=dv)
    st = "i16" if t == "bf16" else t
    g, dq, dv = int(group), int(dq), int(dv)
    props, attrs = render_lowering_attrs(dict(lowering), m_total=int(r), dv=dv, c=int(c))
    if layout == "bhsd":
        fields = dict(seq_dim=2, head_dim=1, q_expand="[0], [1, 2], [3], [4]", q_expand_shape=f"%B, %Hk, {g}, %Sq, {dq}",
                      q5_type=f"tensor<?x?x{g}x?x{dq}x{st}>", q5_map="b, h, g, s, d", kt_map="b, h, j, d", v_map="b, h, j, d",
                      q_shape_doc="[B, Hq, Sq, Dq]", k_shape_doc="[B, Hk, Sk, Dq]", v_shape_doc="[B, Hk, Sk, Dv]",
                      out5_type=f"tensor<?x?x{g}x?x{dv}x{st}>", out_empty="%B, %Hk, %Sq", out_map="b, h, g, s, d",
                      out_collapse="[0], [1, 2], [3], [4]")
    else:
        fields = dict(seq_dim=1, head_dim=2, q_expand="[0], [1], [2, 3], [4]", q_expand_shape=f"%B, %Sq, %Hk, {g}, {dq}",
                      q5_type=f"tensor<?x?x?x{g}x{dq}x{st}>", q5_map="b, s, h, g, d", kt_map="b, j, h, d", v_map="b, j, h, d",
                      q_shape_doc="[B, Sq, Hq, Dq]", k_shape_doc="[B, Sk, Hk, Dq]", v_shape_doc="[B, Sk, Hk, Dv]",
                      out5_type=f"tensor<?x?x?x{g}x{dv}x{st}>", out_empty="%B, %Sq, %Hk", out_map="b, s, h, g, d",
                      out_collapse="[0], [1], [2, 3], [4]")
    return _load("unit_loop.mlir.in").substitute(
        func_name=func_name, layout=layout, ST=st, G=g, R=int(r), C=int(c), Rm1=int(r) - 1, Cm1=int(c) - 1,
        DQ=int(dq), DV=dv, attn_props=props, attn_attrs=attrs, raw_to_f32=_TO_F32[st], f32_to_out=_FROM_F32[st],
        **fields)
