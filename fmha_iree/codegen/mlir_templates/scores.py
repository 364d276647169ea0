"""The score stage every attention op shares: what its score region does to ``q . k`` before the
mask and the softmax.

IREE's ``online_attention`` hands its region the f32 score in log2 units (``scale * log2(e) *
q . k``: the decomposition uses exp2; ``kernels.attention``'s docstring), and applies the mask
operand to what the region yields. The region here:

1. ``pre``: lines that rescale the score (a lowering's ``scale_on_scores``, ``lowering.scores_scale``);
2. the logits soft-cap (Gemma 2, Grok; CK's ``logits_soft_cap``): ``s = cap * tanh(s / cap)`` on
   the natural-log score ``s = scale * q . k``, so in log2 units
   ``t = (cap * log2 e) * tanh(t * ln 2 / cap)``; a masked score stays ``-inf`` (the mask comes after);
3. the yield.

The soft-cap is a constant of the module (``KernelSpec.softcap``: a model's layers share one cap),
so a module without it carries no instruction for it, and one with it folds the two factors.
"""

from __future__ import annotations

import math
from typing import Sequence

__all__ = ["score_region", "softcap_lines", "f32_text"]

LN2 = math.log(2.0)
LOG2E = 1.0 / LN2


def f32_text(x: float) -> str:
    """``x`` as an MLIR f32 literal (enough digits to round-trip a float32)."""
    return f"{float(x):.9e}"


def softcap_lines(value: str, softcap: float, out: str = "%capped") -> list[str]:
    """Lines computing ``out`` = the soft-capped ``value`` (a log2-unit f32 score); none when
    ``softcap`` is 0 (then ``out`` is not defined: use ``value``)."""
    if not softcap:
        return []
    return [f"    {out}_i = arith.constant {f32_text(LN2 / softcap)} : f32",
            f"    {out}_o = arith.constant {f32_text(softcap * LOG2E)} : f32",
            f"    {out}_x = arith.mulf {value}, {out}_i : f32",
            f"    {out}_t = math.tanh {out}_x : f32",
            f"    {out} = arith.mulf {out}_t, {out}_o : f32"]


def score_region(softcap: float = 0.0, pre: Sequence[str] = (), value: str = "%score") -> str:
    """The body of the op's score region (after ``^bb0(%score: f32):``): ``pre`` (lines computing
    ``value`` from ``%score``), the soft-cap, the yield."""
    capped = softcap_lines(value, softcap)
    result = "%capped" if capped else value
    return "\n".join([*pre, *capped, f"    iree_linalg_ext.yield {result} : f32"])
