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
from typing import Mapping, Sequence

__all__ = ["score_region", "softcap_lines", "f32_text", "cap_exp2"]

LN2 = math.log(2.0)
LOG2E = 1.0 / LN2


def f32_text(x: float) -> str:
    """``x`` as an MLIR f32 literal (enough digits to round-trip a float32)."""
    return f"{float(x):.9e}"


def softcap_lines(value: str, softcap: float, out: str = "%capped", exp2: bool | str = False) -> list[str]:
    """Lines computing ``out`` = the soft-capped ``value`` (a log2-unit f32 score); none when
    ``softcap`` is 0 (then ``out`` is not defined: use ``value``). ``exp2``: as ``C - 2C /
    (exp2(2 t / cap) + 1)`` with ``C = cap log2 e`` (the same ``C tanh(t ln 2 / cap)``; large
    scores give ``C``, very negative ones ``-C``), one exp2 and one division instead of
    ``math.tanh``'s polynomial: fewer registers on RDNA (gfx1100 f16 d128 ``fwd``: 238 VGPRs
    against 256 and 2 spilled), more on CDNA (gfx942: up to 65 more per op), so a lowering's
    ``softcap_exp2`` chooses it (docs/BENCHMARKS.md, "Score variants"). ``exp2="fast"``: the
    division approximate (``afn``; CUDA, where the exp2 is the native ``ex2.approx``,
    ``toolchain.ptx``, and tanh's polynomial cost the H100 prefill 35%; on gfx942 ``afn`` spilled
    SGPRs)."""
    if not softcap:
        return []
    if exp2:
        c, fast = softcap * LOG2E, " fastmath<afn>" if exp2 == "fast" else ""
        return [f"    {out}_i = arith.constant {f32_text(2.0 / softcap)} : f32",
                f"    {out}_c = arith.constant {f32_text(c)} : f32",
                f"    {out}_c2 = arith.constant {f32_text(2.0 * c)} : f32",
                f"    {out}_one = arith.constant 1.0 : f32",
                f"    {out}_x = arith.mulf {value}, {out}_i : f32",
                f"    {out}_e = math.exp2 {out}_x : f32",
                f"    {out}_d = arith.addf {out}_e, {out}_one : f32",
                f"    {out}_q = arith.divf {out}_c2, {out}_d{fast} : f32",
                f"    {out} = arith.subf {out}_c, {out}_q : f32"]
    return [f"    {out}_i = arith.constant {f32_text(LN2 / softcap)} : f32",
            f"    {out}_o = arith.constant {f32_text(softcap * LOG2E)} : f32",
            f"    {out}_x = arith.mulf {value}, {out}_i : f32",
            f"    {out}_t = math.tanh {out}_x : f32",
            f"    {out} = arith.mulf {out}_t, {out}_o : f32"]


def score_region(softcap: float = 0.0, pre: Sequence[str] = (), value: str = "%score", exp2: bool | str = False) -> str:
    """The body of the op's score region (after ``^bb0(%score: f32):``): ``pre`` (lines computing
    ``value`` from ``%score``), the soft-cap (``exp2``: ``softcap_lines``' form), the yield."""
    capped = softcap_lines(value, softcap, exp2=exp2)
    result = "%capped" if capped else value
    return "\n".join([*pre, *capped, f"    iree_linalg_ext.yield {result} : f32"])


def cap_exp2(lowering) -> bool | str:
    """A lowering's (a dict, ``"cpu"`` or None) ``softcap_exp2``: ``softcap_lines``' form."""
    return lowering.get("softcap_exp2", False) if isinstance(lowering, Mapping) else False
