"""The plan's ``step``: one wave as gathers + one ``online_attention`` + scatters back into the
state (``mlir/online_step.mlir.in``).
"""

from __future__ import annotations

from typing import Any, Mapping

from .lowering import _DTYPES, _load, render_lowering_attrs

def render_online_step(*, func_name: str, dtype: str, layout: str, group: int, r: int, c: int,
                       dq: int, dv: int, lowering: Mapping[str, Any] | str | None = None) -> str:
    """MLIR text of `util.func public @func_name` implementing one wave of the plan.

    Signature (dynamic: B, Sq, Sk, Hq, Hk, NT, P; M = group * r):
      (q, k, v: tensor<?x?x?xDxT> in `layout` ("bshd" or "bhsd"), scale: tensor<1xf32>,
       acc: tensor<?x?xMxDvxf32>, m: tensor<?x?xMxf32>, l: tensor<?x?xMxf32>,
       desc: tensor<?x10xi32>) -> (acc, m, l)
    """
    t = _DTYPES.get(str(dtype))
    if t is None:
        raise ValueError(f"dtype {dtype!r} not in f16/bf16/f32")
    if layout not in ("bshd", "bhsd"):
        raise ValueError(f"layout {layout!r} not in bshd/bhsd")
    for name, val in (("group", group), ("r", r), ("c", c), ("dq", dq), ("dv", dv)):
        if int(val) <= 0:
            raise ValueError(f"{name} must be positive, got {val}")
    m_total = int(group) * int(r)
    if layout == "bshd":
        seq_dim = 1
        q_index = "%b, %s, %hq, %i2"
        kv_index = "%b, %s, %h, %i2"
        q_doc, k_doc, v_doc = "[B,Sq,Hq,Dq]", "[B,Sk,Hk,Dq]", "[B,Sk,Hk,Dv]"
    else:
        seq_dim = 2
        q_index = "%b, %hq, %s, %i2"
        kv_index = "%b, %h, %s, %i2"
        q_doc, k_doc, v_doc = "[B,Hq,Sq,Dq]", "[B,Hk,Sk,Dq]", "[B,Hk,Sk,Dv]"
    if t == "f32":
        scale_cast = "  %scale_t = arith.addf %scale_f32, %zero : f32"
    else:
        scale_cast = f"  %scale_t = arith.truncf %scale_f32 : f32 to {t}"
    attn_props, attn_attrs = render_lowering_attrs(lowering, m_total=m_total, dv=int(dv),
                                                   c=int(c))
    return _load("online_step.mlir.in").substitute(
        func_name=func_name, T=t, G=int(group), R=int(r), C=int(c), DQ=int(dq), DV=int(dv),
        M=m_total, layout=layout, seq_dim=seq_dim, q_index=q_index, kv_index=kv_index,
        q_shape_doc=q_doc, k_shape_doc=k_doc, v_shape_doc=v_doc, scale_cast=scale_cast,
        attn_props=attn_props, attn_attrs=attn_attrs)
