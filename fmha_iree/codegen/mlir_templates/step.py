"""The plan's ``step``: one wave as gathers + one ``online_attention`` + scatters back into the
state (``mlir/online_step.mlir.in``).
"""

from __future__ import annotations

from typing import Any, Mapping

from .lowering import _load, checked_fields, render_lowering_attrs, scale_operand

def render_online_step(*, func_name: str, dtype: str, layout: str, group: int, r: int, c: int,
                       dq: int, dv: int, lowering: Mapping[str, Any] | str | None = None,
                       masked: bool = True, compute_dims: tuple[int, int] | None = None, softcap: float = 0.0) -> str:
    """MLIR text of `util.func public @func_name` implementing one wave of the plan.

    Signature (dynamic: B, Sq, Sk, Hq, Hk, NT, P; M = group * r):
      (q, k, v: tensor<?x?x?xDxT> in `layout` ("bshd" or "bhsd"), scale: tensor<1xf32>,
       acc: tensor<?x?xMxDvxf32>, m: tensor<?x?xMxf32>, l: tensor<?x?xMxf32>,
       desc: tensor<?x10xi32>) -> (acc, m, l)

    A CPU ``lowering`` (``{"backend": "cpu", ...}``) takes the gathers of
    ``mlir/step_gathers_cpu.mlir.in`` (K gathered transposed, lowering configs of their own);
    other lowerings those of ``mlir/step_gathers.mlir.in``. ``masked=False`` (CPU only) leaves
    the visibility mask out: the function then takes only units whose rows all see every key of
    their chunk (``plan.Block.unmasked``). ``compute_dims`` (GPU gathers only): the head dims
    ``(Dq', Dv')`` the op computes at, the gathered tiles zero past ``dq`` / ``dv`` and the op's
    output cut back to ``dv`` (``lowering`` is then that of the wider dims). ``softcap``: the
    module's logits soft-cap (``scores``).
    """
    t = checked_fields(dtype, layout, group=group, r=r, c=c, dq=dq, dv=dv)
    dqp, dvp = (int(dq), int(dv)) if compute_dims is None else map(int, compute_dims)
    if dqp < int(dq) or dvp < int(dv):
        raise ValueError(f"compute_dims {compute_dims} narrower than the head dims {dq} / {dv}")
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
    cpu = isinstance(lowering, Mapping) and lowering.get("backend") == "cpu" or lowering == "cpu"
    st = "i16" if cpu and t == "bf16" else t  # CPU modules pass bf16 as its int16 bits
    if cpu:
        t = "f32"
        if (dqp, dvp) != (int(dq), int(dv)):
            raise ValueError("compute_dims wider than the head dims are rendered for GPU gathers only")
    defs, score_body = scale_operand(lowering, t, softcap)  # scale_on_scores: kernels.attention's docstring
    scale_cast = "\n".join("  " + d for d in defs)
    attn_props, attn_attrs = render_lowering_attrs(lowering, m_total=m_total, dv=dvp, c=int(c))
    fields = dict(T=t, ST=st, G=int(group), R=int(r), C=int(c), DQ=int(dq), DV=int(dv), DQP=dqp, DVP=dvp,
                  M=m_total, q_index=q_index, kv_index=kv_index)
    if not (masked or cpu):
        raise ValueError("an unmasked step is rendered for CPU lowerings only")
    k_tile = (int(dq), int(c)) if cpu else (int(c), dqp)
    return _load("online_step.mlir.in").substitute(
        func_name=func_name, layout=layout, seq_dim=seq_dim, q_shape_doc=q_doc, k_shape_doc=k_doc,
        v_shape_doc=v_doc, scale_cast=scale_cast, score_body=score_body, attn_props=attn_props, attn_attrs=attn_attrs,
        gathers=_gathers(fields, cpu, masked), K_TILE=f"{k_tile[0]}x{k_tile[1]}",
        k_map="(d0, d2, d3)" if cpu else "(d0, d3, d2)", **_mask_fields(masked, m_total, int(c)), **fields)


def _gathers(fields: dict, cpu: bool, masked: bool) -> str:
    """The step's gathers of Q / K / V and its mask (``fields``: the template's static fields)."""
    if not cpu:
        at = {k: fields[k].replace("%i2", "%dcol") for k in ("q_index", "kv_index")}
        return _load("step_gathers.mlir.in").substitute(
            {**fields, **at}, q_col=_column(fields["DQ"], fields["DQP"]), v_col=_column(fields["DV"], fields["DVP"]))
    mask = _load("step_mask_cpu.mlir.in").substitute(**fields, **_CPU_GATHER_CONFIGS) if masked else ""
    iotas = _iotas({fields["M"], fields["C"], fields["DQ"], fields["DV"]})
    return _load("step_gathers_cpu.mlir.in").substitute(iotas=iotas, to_t=_TO_F32[fields["ST"]], mask=mask,
                                                        **fields, **_CPU_GATHER_CONFIGS)


def _column(d: int, dp: int) -> str:
    """A gather's head-dim column: ``%dcol`` (the argument's column read) and ``%din`` (whether
    the op's column ``%i2`` lies inside the argument's ``d``; the op computes at ``dp``)."""
    if d == dp:  # both fold away
        return "    %dcol = arith.addi %i2, %c0 : index\n    %din = arith.constant true"
    return (f"    %dlast = arith.constant {d - 1} : index\n    %dcol = arith.minui %i2, %dlast : index\n"
            f"    %dlen = arith.constant {d} : index\n    %din = arith.cmpi ult, %i2, %dlen : index")


def _mask_fields(masked: bool, m_total: int, c: int) -> dict:
    """The attention op's mask operand, its type and its indexing map (empty when unmasked)."""
    if not masked:
        return dict(mask_operand="", mask_type="", mask_map="")
    return dict(mask_operand=", %mask", mask_type=f", tensor<?x{m_total}x{c}xi1>",
                mask_map="\n        affine_map<(d0, d1, d2, d3, d4) -> (d0, d1, d3)>,")


# A gathered element ``%raw`` (storage type) as ``%val`` in f32.
_TO_F32 = {"f32": "    %val = arith.bitcast %raw : f32 to f32",
           "f16": "    %val = arith.extf %raw : f16 to f32",
           "i16": "    %rawb = arith.bitcast %raw : i16 to bf16\n    %val = arith.extf %rawb : bf16 to f32"}


def _cpu_config(dist: list[int], vec: list[int]) -> str:
    return ("compilation_info = #iree_codegen.compilation_info<lowering_config = #iree_cpu.lowering_config<"
            f"distribution = {dist}, vector_common_parallel = {vec}>, translation_info = "
            "#iree_codegen.translation_info<pipeline = #iree_cpu.pipeline<DoubleTilingExpert>>>,")


# Workgroups of one unit and head: 64 rows of Q / the mask, 16 head-dim rows of K^T, 64 keys of V,
# each by its whole last dim; vectors of 16 f32 along that dim (the mask: 64 keys).
_CPU_GATHER_CONFIGS = {
    "q_config": _cpu_config([1, 1, 64, 0], [1, 1, 1, 16]),
    "k_config": _cpu_config([1, 1, 16, 0], [1, 1, 1, 16]),
    "v_config": _cpu_config([1, 1, 64, 0], [1, 1, 1, 16]),
    "mask_config": _cpu_config([1, 1, 64, 0], [1, 1, 1, 64]),
}


def _iotas(sizes: set[int]) -> str:
    """``%iota_N = arith.constant dense<[0, ..., N - 1]> : tensor<Nxi32>`` for each size."""
    return "\n".join(f"  %iota_{n} = arith.constant dense<[{', '.join(map(str, range(n)))}]> : tensor<{n}xi32>"
                     for n in sorted(sizes))
