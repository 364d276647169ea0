"""The one place that writes an ``iree_linalg_ext.online_attention`` op.

Iteration dims are ``(b0 .. b{nb-1}, m, k1, k2, n)``: batch dims, query rows, the Q.K head dim,
keys, the V head dim. Every operand is given with the dims it is indexed by, so the same op serves
K/V read in place in either layout (``bhsd``: ``(b, h, k2, k1)``; ``bshd``: ``(b, k2, h, k1)``)
and split-KV pieces as a third batch dim. The op's max is in log2 units (IREE's decomposition
uses exp2); a mask operand adds ``-inf`` where it is false.

IREE scales Q by ``scale * log2(e)`` in Q's own element type before Q K^T. In bf16 on gfx942 and
gfx1100 (the ISA read) that multiply is emulated, each element a dozen integer ops whose results
stay live (gfx1100 bf16 d256's ``step``: 90 VGPRs spilled). A lowering with
``scale_on_scores`` gives the op the scale ``lowering.SCALE_ONE`` instead (``lowering.scores_scale``), whose product with
IREE's log2(e) folds to 1 so that the multiply of Q folds away, and multiplies the f32 scores by
the true ``scale * log2(e)`` in the op's score region (that ``step``: no spill; gfx942 bf16 d128's
masked ``fwd`` op: fewer instructions; iree-compile 3.13, docs/BENCHMARKS.md "bf16's scale on the scores").
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from ..mlir_templates.lowering import lowering_for_runtime_sizes, scores_scale
from ..mlir_templates.scores import cap_exp2, score_region
from .ir import Fn

__all__ = ["Operand", "online_attention", "lowering_attrs"]


@dataclasses.dataclass(frozen=True)
class Operand:
    """An SSA value with its type and the iteration dims that index it."""

    name: str
    type: str
    dims: tuple[str, ...]


def lowering_attrs(lowering, *, dv: int, batch_dims: int, k2o: bool = False, masked: bool = False) -> tuple[str, str]:
    """(properties, attributes) for the op; ("", "") lets IREE choose. The tile sizes are checked
    against a whole tile (the sizes themselves are runtime values the caller proves divisible).
    A GPU lowering's ``masked`` entry (a dict) overrides its fields for ops with a mask operand:
    the same workgroup rows, another subgroup layout (``fwd_plan`` on wave32 targets)."""
    if isinstance(lowering, dict) and "masked" in lowering:
        base = {k: v for k, v in lowering.items() if k != "masked"}
        lowering = {**base, **lowering["masked"]} if masked else base
    return lowering_for_runtime_sizes(lowering, dv, batch_dims, k2o)


def _map(dims: Sequence[str], nb: int, k2o: bool = False) -> str:
    all_dims = [f"b{i}" for i in range(nb)] + ["m", "k1", *(["k2o"] if k2o else []), "k2", "n"]
    return f"affine_map<({', '.join(all_dims)}) -> ({', '.join(dims)})>"


def _score_scale(fn: Fn, scale: str, scale_type: str) -> tuple[str, list[str]]:
    """(the op's scale operand, its score region's lines computing ``%scaled``) for a lowering with
    ``scale_on_scores`` (module docstring): ``scale * log2(e)`` in f32 multiplies the scores."""
    # emitted where the op is (a dispatch region's body is isolated from the function's constants);
    # scores_scale refuses a scale type other than bf16
    names = (fn.fresh("sone"), fn.fresh("log2e"), fn.fresh("sl"))
    defs, body = scores_scale(fn.let(f"arith.extf {scale} : {scale_type} to f32", "sf"), scale_type, names)
    for line in defs:
        fn.emit(line)
    return names[0], body


def online_attention(fn: Fn, *, q: Operand, k: Operand, v: Operand, scale: str, scale_type: str,
                     outs: Sequence[Operand], nb: int, lowering, dv: int, mask: Operand | None = None,
                     k2o: bool = False, softcap: float = 0.0, bias: Operand | None = None) -> list[str]:
    """Emit the op (``outs``: acc, max, sum as its initial state); returns its three results.
    ``k2o``: keys in two dims, ``k2o`` (outer, one per step) and ``k2``. ``softcap``: the
    module's logits soft-cap (``scores``), 0 for none. ``bias``: a float mask (natural-log units
    added to the scores) in place of ``mask`` on an op that keeps the unmasked layout."""
    assert mask is None or bias is None, "an op takes one mask operand"
    props, attrs = lowering_attrs(lowering, dv=dv, batch_dims=nb, k2o=k2o, masked=mask is not None)
    mask = mask if bias is None else bias
    body = score_region(softcap, exp2=cap_exp2(lowering))
    if isinstance(lowering, dict) and lowering.get("scale_on_scores"):
        scale, pre = _score_scale(fn, scale, scale_type)
        body = score_region(softcap, pre, "%scaled", exp2=cap_exp2(lowering))
    _m = lambda dims: _map(dims, nb, k2o)  # noqa: E731
    maps = [_m(q.dims), _m(k.dims), _m(v.dims), _m(())]
    ins = [q.name, k.name, v.name, scale]
    in_tys = [q.type, k.type, v.type, scale_type]
    if mask is not None:
        maps.append(_m(mask.dims))
        ins.append(mask.name)
        in_tys.append(mask.type)
    maps += [_m(o.dims) for o in outs]
    res = [fn.fresh("att") for _ in outs]
    out_tys = ", ".join(o.type for o in outs)
    props_text = (props + "\n    ") if props else ""
    fn.emit(
        f"{', '.join(res)} = iree_linalg_ext.online_attention <{{{props_text}indexing_maps = [\n      "
        + ",\n      ".join(maps) + f"]}}>{attrs}\n"
        f"    ins({', '.join(ins)} : {', '.join(in_tys)})\n"
        f"    outs({', '.join(o.name for o in outs)} : {out_tys}) {{\n"
        "  ^bb0(%score: f32):\n" + body + "\n"
        f"  }} -> {out_tys}")
    return res
