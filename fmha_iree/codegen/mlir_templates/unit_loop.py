"""The CPU's batch-mode ``units`` entry point: the tile plan's units as a loop inside the module
(``mlir/unit_loop.mlir.in``), each unit one ``online_attention`` of static shape.
"""

from __future__ import annotations

from typing import Any, Mapping

from .lowering import _load, checked_fields, render_lowering_attrs
from .scores import score_region
from .step import _TO_F32

__all__ = ["render_unit_loop", "render_tile_steps", "LOOP_AFFINITY"]

# An f32 (%ov) to the output's storage type (%res); a storage element (%raw) to f32 (%val) is
# the step's ``_TO_F32``.
_FROM_F32 = {"f32": "    %res = arith.addf %ov, %zero : f32",
             "f16": "    %res = arith.truncf %ov : f32 to f16",
             "i16": "    %rb = arith.truncf %ov : f32 to bf16\n    %res = arith.bitcast %rb : bf16 to i16"}


# The tiles' loop placed on the module's device (``--iree-hal-target-device=local`` names it
# ``__device_0``). Without it IREE 3.13 gives the loop-carried state no affinity and copies all of
# it into a fresh buffer at every tile (``stream.async.transfer`` to the same device; a loop whose
# steps sat under an scf.if then failed at run time: the steps are loops of one kind). docs/tried.md,
# "Group mode in one call: how the tile loop reached its form".
LOOP_AFFINITY = " {stream.affinity = #hal.device.affinity<@__device_0>}"


def render_step(tag: str, width: int, masked: bool, *, batch: str, r: int, dq: int, dv: int, props: str,
                attrs: str, own_keys: bool = False, softcap: float = 0.0) -> str:
    """The body of a unit loop's step loop (``mlir/unit_step.mlir.in``): one ``online_attention``
    over ``width`` keys from ``%kg`` on, ``batch`` (an SSA name) heads, masked by ``%mask``;
    ``own_keys``: keys from the sequence's ``%lk`` on read as zeros (``mlir/unit_slices_own.mlir.in``);
    ``softcap``: the module's logits soft-cap (``scores``)."""
    slices = _load("unit_slices_own.mlir.in" if own_keys else "unit_slices.mlir.in").substitute(
        tag=tag, W=width, BATCH=batch, DQ=dq, DV=dv)
    return _load("unit_step.mlir.in").substitute(
        tag=tag, W=width, what="masked" if masked else "every row sees every key", R=r, DQ=dq, DV=dv,
        slices=slices, attn_props=props, attn_attrs=attrs, score_body=score_region(softcap),
        mask_map="\n              affine_map<(d0, d1, d2, d3, d4) -> (d1, d3)>," if masked else "",
        mask_arg=", %mask" if masked else "", mask_type=f", tensor<{r}x{width}xi1>" if masked else "")


def render_tile_steps(*, batch: str, kbase: str, kmax: str, klen: str, r: int, c: int, c_narrow: int, dq: int,
                      dv: int, props: str, attrs: str, own_keys: bool = False, softcap: float = 0.0) -> tuple[str, str]:
    """The text both unit loops share (``mlir/unit_counts.mlir.in``, ``mlir/unit_steps.mlir.in``):
    a tile's step counts and its three step loops (open ``c``-key, open ``c_narrow``-key, masked
    ``c_narrow``-key). SSA names: ``batch`` heads per op, ``kbase`` the sequence's first key in K^T
    / V, ``kmax`` the largest first key a masked step may read from, ``klen`` its key count."""
    kw = dict(batch=batch, r=r, dq=dq, dv=dv, props=props, attrs=attrs, softcap=softcap)
    fields = dict(BATCH=batch, KBASE=kbase, KMAX=kmax, KLEN=klen, R=r, DV=dv, CN=c_narrow)
    counts = _load("unit_counts.mlir.in").substitute(KLEN=klen)

    def masked(name: str, first: str, last: str, init: str, own: bool) -> str:
        return _load("unit_masked.mlir.in").substitute(
            name=name, first=first, last=last, init=init,
            step=render_step("p" if own else "m", c_narrow, True, own_keys=own, **kw), **fields)

    if own_keys:  # the steps inside the sequence's keys read them in place, the rest (one) padded
        loops = (_load("unit_inside.mlir.in").substitute(KLEN=klen) + masked("ui", "%c0", "%nIn", "nr", False) +
                 _TIE.format(name="ui", batch=batch, r=r, dv=dv) + masked("u", "%nIn", "%nN", "ui", True))
    else:
        loops = masked("u", "%c0", "%nN", "nr", False)
    steps = _load("unit_steps.mlir.in").substitute(
        open_wide=render_step("w", c, False, **kw), open_narrow=render_step("n", c_narrow, False, **kw),
        masked_loops=loops, **fields)
    return counts, steps


_TIE = """    %{name}0 = flow.tensor.tie_shape %{name}#0 : tensor<?x{r}x{dv}xf32>{{{batch}}}
    %{name}1 = flow.tensor.tie_shape %{name}#1 : tensor<?x{r}xf32>{{{batch}}}
    %{name}2 = flow.tensor.tie_shape %{name}#2 : tensor<?x{r}xf32>{{{batch}}}
"""


def render_unit_loop(*, func_name: str, dtype: str, layout: str, group: int, r: int, c: int, c_narrow: int, dq: int,
                     dv: int, lowering: Mapping[str, Any], softcap: float = 0.0) -> str:
    """MLIR text of ``util.func public @func_name(q, k, v, scale: f32, y: i64, x: i64) -> (out,
    lse)``: any batch-mode problem (runtime B, Sq, Sk, heads; CK's mask coordinates ``(y, x)``)
    as tiles of ``r`` rows in a loop inside the module, each over open steps of ``c`` keys and
    masked ones of ``c_narrow``, each step's ``online_attention`` carrying the CPU ``lowering``
    (``tiles.CPU_STEP_LOWERING``). bf16 is passed as its int16 bits, as the CPU's other entry
    points take it."""
    t = checked_fields(dtype, layout, group=group, r=r, c=c, c_narrow=c_narrow, dq=dq, dv=dv)
    if c % c_narrow:
        raise ValueError(f"c ({c}) must be a multiple of c_narrow ({c_narrow})")
    st = "i16" if t == "bf16" else t
    g, dq, dv = int(group), int(dq), int(dv)
    props, attrs = render_lowering_attrs(dict(lowering), m_total=int(r), dv=dv, c=int(c_narrow))
    counts, steps = render_tile_steps(batch="%BH", kbase="%c0", kmax="%Skc", klen="%Sk", r=int(r), c=int(c),
                                      c_narrow=int(c_narrow), dq=dq, dv=dv, props=props, attrs=attrs, softcap=softcap)
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
        func_name=func_name, layout=layout, ST=st, G=g, R=int(r), C=int(c), CN=int(c_narrow), Rm1=int(r) - 1,
        Cm1=int(c) - 1, DQ=int(dq), DV=dv, raw_to_f32=_TO_F32[st], f32_to_out=_FROM_F32[st],
        tile_counts=counts, tile_steps=steps, loop_affinity=LOOP_AFFINITY, **fields)
