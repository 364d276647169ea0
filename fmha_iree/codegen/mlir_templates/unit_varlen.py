"""The CPU's ``units_varlen`` entry point: group mode's long sequences in one call, every
sequence's row tiles looped inside the module from a table the host builds
(``mlir/unit_varlen.mlir.in``; each step one ``online_attention`` of static shape,
``mlir/unit_step.mlir.in``).
"""

from __future__ import annotations

from typing import Any, Mapping

from .lowering import _load, checked_fields, render_lowering_attrs
from .step import _TO_F32
from .unit_loop import _FROM_F32, LOOP_AFFINITY, render_tile_steps

__all__ = ["render_unit_varlen", "TILE_COLUMNS"]

# The columns of the tile table (one row per R-row tile and query head of a KV head, ordered by
# head, then row): the tile's first packed row (q_start + s0), its first row within the sequence,
# the sequence's query count, first key, key count, CK's (y, x) for its lengths, the query head g.
from ...problem.abi import UNIT_TILE_COLUMNS as TILE_COLUMNS

_ZERO = {"f32": "0.0 : f32", "f16": "0.0 : f16", "i16": "0 : i16"}


def render_unit_varlen(*, func_name: str, dtype: str, group: int, r: int, c: int, c_narrow: int, dq: int, dv: int,
                       lowering: Mapping[str, Any], softcap: float = 0.0) -> str:
    """MLIR text of ``util.func public @func_name(q, k, v, tiles, scale: f32) -> (out, lse)``: packed
    sequences (bshd ``[1, T, H, D]``) whose R-row tiles the ``tiles`` table lists
    (``TILE_COLUMNS``), keys in open chunks of ``c`` and masked or open ones of ``c_narrow``, each
    step's ``online_attention`` carrying the CPU ``lowering`` (``tiles.CPU_STEP_LOWERING``)."""
    t = checked_fields(dtype, "bshd", group=group, r=r, c=c, c_narrow=c_narrow, dq=dq, dv=dv)
    if c % c_narrow:
        raise ValueError(f"c ({c}) must be a multiple of c_narrow ({c_narrow})")
    st = "i16" if t == "bf16" else t
    r, dq, dv = int(r), int(dq), int(dv)
    props, attrs = render_lowering_attrs(dict(lowering), m_total=r, dv=dv, c=int(c_narrow))
    counts, steps = render_tile_steps(batch="%Hk", kbase="%ks", kmax="%Tkc", klen="%lk", r=r, c=int(c),
                                      c_narrow=int(c_narrow), dq=dq, dv=dv, props=props, attrs=attrs, own_keys=True,
                                      softcap=softcap)
    return _load("unit_varlen.mlir.in").substitute(
        func_name=func_name, ST=st, G=int(group), R=r, C=int(c), CN=int(c_narrow), DQ=dq, DV=dv,
        raw_to_f32=_TO_F32[st], f32_to_out=_FROM_F32[st], zero_st=_ZERO[st], tile_counts=counts, tile_steps=steps,
        loop_affinity=LOOP_AFFINITY)
