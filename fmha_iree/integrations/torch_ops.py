"""torch-native entry points: ``torch.ops.fmha_iree.fmha_fwd`` and ``torch.ops.fmha_iree.fmha_fwd_varlen``
(``torch.library`` custom ops with fake kernels, so ``torch.compile(fullgraph=True)`` and
``torch.export`` see through them), :func:`fmha_fwd_varlen` (group mode with the keyword arguments
of :func:`fmha_iree.fmha_fwd_varlen`) and :func:`sdpa`, a drop-in for
``torch.nn.functional.scaled_dot_product_attention``.

Importing this module registers the ops (``import fmha_iree.integrations.torch_ops``); nothing else in the
package imports torch at import time. Torch tensors on the CPU, or on a GPU (shared with IREE both ways
through DLPack, as :func:`fmha_iree.fmha_fwd` takes them: ``fmha_iree.runtime.torch_gpu``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..api import fmha_fwd, fmha_fwd_varlen as _fmha_fwd_varlen
from ..paths.sink_tokens import has_sink_tokens, with_batch_sink_tokens, with_varlen_sink_tokens
from ..paths.sinks import varlen_rows, with_sinks
from ..problem.alibi import refuse_sink_tokens
from ..problem.fp8 import dequantized_kv
from ..problem.mask import Mask
from ..problem.spec import check_softcap

__all__ = ["attention", "sdpa", "mask_of", "fmha_fwd_varlen"]


@torch.library.custom_op("fmha_iree::fmha_fwd", mutates_args=())
def _fmha_fwd_op(q: Tensor, k: Tensor, v: Tensor, mask: str, scale: float | None,
                 layout: str, softcap: float | None = None, bias: Tensor | None = None,
                 alibi_slopes: Tensor | None = None) -> tuple[Tensor, Tensor]:
    out, lse = fmha_fwd(q, k, v, mask=mask, scale=scale, layout=layout, return_lse=True, softcap=softcap, bias=bias,
                        alibi_slopes=alibi_slopes)
    return out, lse


@_fmha_fwd_op.register_fake
def _(q, k, v, mask, scale, layout, softcap=None, bias=None, alibi_slopes=None):
    b, x1, x2, _ = q.shape
    hq, sq = (x1, x2) if layout == "bhsd" else (x2, x1)
    return q.new_empty(q.shape[:3] + (v.shape[-1],)), q.new_empty((b, hq, sq), dtype=torch.float32)


@torch.library.custom_op("fmha_iree::fmha_fwd_varlen", mutates_args=())
def _fmha_fwd_varlen_op(q: Tensor, k: Tensor, v: Tensor, seqstart_q: Tensor, seqstart_k: Tensor | None = None,
                        seqlen_k: Tensor | None = None, seqstart_padded_q: Tensor | None = None,
                        seqstart_padded_k: Tensor | None = None, block_table: Tensor | None = None,
                        mask: str = "0", scale: float | None = None,
                        softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """Group mode (:func:`fmha_iree.fmha_fwd_varlen`): ``out [Tq, Hq, Dv]`` and float32
    ``lse [Hq, seqstart_q[-1]]``. The LSE's length is the *value* of ``seqstart_q[-1]``: under
    ``torch.compile`` / ``torch.export`` it is an unbacked (data-dependent) size."""
    out, lse = _fmha_fwd_varlen(q, k, v, seqstart_q, seqstart_k, seqlen_k=seqlen_k, seqstart_padded_q=seqstart_padded_q,
                                seqstart_padded_k=seqstart_padded_k, block_table=block_table, mask=mask, scale=scale,
                                return_lse=True, softcap=softcap)
    return out, lse


@_fmha_fwd_varlen_op.register_fake
def _(q, k, v, seqstart_q, seqstart_k=None, seqlen_k=None, seqstart_padded_q=None, seqstart_padded_k=None,
      block_table=None, mask="0", scale=None, softcap=None):
    if q.ndim != 3 or v.ndim not in (3, 4):
        raise ValueError(f"fmha_fwd_varlen takes q [Tq, Hq, Dq] and v [Tk, Hk, Dv] (paged: [pages, page_size, Hk, "
                         f"Dv]), got q {list(q.shape)} and v {list(v.shape)}")
    total_q = torch.library.get_ctx().new_dynamic_size()  # seqstart_q[-1]
    return q.new_empty((q.shape[0], q.shape[1], v.shape[-1])), q.new_empty((q.shape[1], total_q), dtype=torch.float32)


def attention(q: Tensor, k: Tensor, v: Tensor, *, mask=None, scale: float | None = None, layout: str = "bhsd",
              return_lse: bool = False, softcap: float | None = None, sinks: Tensor | None = None,
              bias: Tensor | None = None, alibi_slopes: Tensor | None = None, k_descale=None, v_descale=None):
    """Batch-mode attention with CK's semantics for torch models: :func:`fmha_iree.fmha_fwd`
    through ``torch.ops.fmha_iree.fmha_fwd``. Eager calls run fmha_iree's modules; in a model
    exported with ``fmha_iree.integrations.model_export.export_model`` each call becomes fmha_iree's
    kernel inside the model. ``mask``: None, a CK mask string or a :class:`fmha_iree.Mask` (fixed
    per call site: the lengths are runtime values); ``out``, or ``(out, lse)`` with lse float32
    ``[B, Hq, Sq]``. ``softcap`` and ``sinks`` as in :func:`fmha_iree.fmha_fwd` (the sinks are
    torch ops on the op's results, so an exported model computes them in its own graph); ``bias``
    (a tensor broadcastable to ``[B, Hq, Sq, Sk]``) and ``alibi_slopes`` (``[Hq]`` or ``[B, Hq]``)
    too, eager and under ``torch.compile`` (not inside exported models yet). fp8 ``k`` / ``v``
    with ``k_descale`` / ``v_descale`` (a float or ``[Hk]``) are dequantized to q's dtype by torch
    ops before the op (``fmha_iree.problem.fp8``), eager, compiled and exported alike."""
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    k, v, _ = dequantized_kv(q, k, v, k_descale, v_descale, layout=layout)
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    for name, x in (("bias", bias), ("alibi_slopes", alibi_slopes)):
        if x is not None and not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(x).__name__}")
    args = (None if scale is None else float(scale), layout, check_softcap(softcap) or None, bias, alibi_slopes)

    def run(m=mask):
        def op():
            return torch.ops.fmha_iree.fmha_fwd(q, k, v, _mask_str(m), *args)
        return op() if sinks is None else with_sinks(op, q, sinks, 1 if layout == "bhsd" else 2, layout, True)

    if has_sink_tokens(mask):
        refuse_sink_tokens(alibi_slopes, bias)
        return with_batch_sink_tokens(run, q, k, v, mask=mask, scale=scale, layout=layout, cu_seqlen_q=None,
                                      cu_seqlen_k=None, softcap=softcap, return_lse=return_lse)
    out, lse = run()
    return (out, lse) if return_lse else out


def fmha_fwd_varlen(q, k, v, seqstart_q, seqstart_k, *, seqlen_k=None, seqstart_padded_q=None, seqstart_padded_k=None,
                    block_table=None, mask=None, scale=None, return_lse=False, softcap=None, sinks=None,
                    k_descale=None, v_descale=None):
    """:func:`fmha_iree.fmha_fwd_varlen` through ``torch.ops.fmha_iree.fmha_fwd_varlen`` (torch tensors; the
    int32 start / length arrays as tensors too): ``out [Tq, Hq, Dv]``, or ``(out, lse)`` with lse float32
    ``[Hq, seqstart_q[-1]]``. ``mask``: None, a CK mask string or a :class:`fmha_iree.Mask`; ``softcap``,
    ``sinks``, ``k_descale``, ``v_descale`` as in :func:`attention`."""
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    k, v, block_table = dequantized_kv(q, k, v, k_descale, v_descale, group=True,
                                             block_table=block_table, seqlen_k=seqlen_k)
    ints = dict(seqstart_q=seqstart_q, seqstart_k=seqstart_k, seqlen_k=seqlen_k, seqstart_padded_q=seqstart_padded_q,
                seqstart_padded_k=seqstart_padded_k, block_table=block_table)
    for name, x in ints.items():
        if x is not None and not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor (int32) or None, got {type(x).__name__}")
    args = (seqstart_q, seqstart_k, seqlen_k, seqstart_padded_q, seqstart_padded_k, block_table)
    rest = (scale, check_softcap(softcap) or None)

    def run(m=mask):
        def op():
            return torch.ops.fmha_iree.fmha_fwd_varlen(q, k, v, *args, _mask_str(m), *rest)
        return op() if sinks is None else with_sinks(op, q, sinks, 1, "thd", True,
                                                     varlen_rows(seqstart_q, seqstart_padded_q))

    if has_sink_tokens(mask):
        return with_varlen_sink_tokens(run, q, k, v, seqstart_q, seqstart_k, seqlen_k=seqlen_k,
                                       seqstart_padded_q=seqstart_padded_q, seqstart_padded_k=seqstart_padded_k,
                                       block_table=block_table, mask=mask, scale=scale, softcap=softcap,
                                       return_lse=return_lse)
    out, lse = run()
    return (out, lse) if return_lse else out


def _mask_str(mask) -> str:
    if mask is None:
        return "0"
    if isinstance(mask, str):
        return str(Mask.from_str(mask))  # a ValueError naming mask before anything runs
    if isinstance(mask, Mask):
        return str(mask)
    raise TypeError(f"mask must be None, a CK mask string or a fmha_iree.Mask, got {type(mask).__name__}")


def mask_of(attn_mask: torch.Tensor | None, is_causal: bool, sq: int, sk: int) -> str:
    """The CK mask string of torch's ``attn_mask`` / ``is_causal`` (torch's ``is_causal`` is
    top-left: row i sees keys j <= i). A boolean ``attn_mask`` shared by every batch and head is
    taken when each row's visible keys form one run ``i + d - l <= j <= i + d + r`` with the same
    ``l``, ``r`` for every row, top-left (``d = 0``) or bottom-right (``d = Sk - Sq``; tried first
    when Sq < Sk, as with a KV cache); anything else is a ``ValueError`` naming ``attn_mask``."""
    if attn_mask is None:
        return "t" if is_causal else "0"
    if is_causal:
        raise ValueError("attn_mask and is_causal cannot both be given (as in torch)")
    if not isinstance(attn_mask, torch.Tensor) or attn_mask.dtype != torch.bool:
        raise ValueError("attn_mask: only boolean masks are CK masks (a float mask is a bias: sdpa takes it)")
    m = attn_mask
    while m.ndim > 2 and m.shape[0] == 1:
        m = m[0]
    if m.ndim != 2 or tuple(m.shape) != (sq, sk):
        raise ValueError(f"attn_mask must be [Sq, Sk] = [{sq}, {sk}] for every batch and head, got "
                         f"{list(attn_mask.shape)}")
    return _window(m.cpu(), sq, sk)


def _window(m: torch.Tensor, sq: int, sk: int) -> str:
    """``t:l,r`` / ``b:l,r`` (``t`` / ``b`` when causal) for a boolean [Sq, Sk] mask that is a
    window (``-1``: unlimited side)."""
    if bool(m.all()):
        return "0"
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    for top_left in ((False, True) if sq < sk else (True, False)):
        shift = 0 if top_left else sk - sq
        for left in _candidates(m, shift, lower=True):
            for right in _candidates(m, shift, lower=False):
                vis = torch.ones(sq, sk, dtype=torch.bool)
                if left >= 0:
                    vis &= j >= i + shift - left
                if right >= 0:
                    vis &= j <= i + shift + right
                if torch.equal(vis, m):
                    side = "t" if top_left else "b"
                    return side if (left, right) == (-1, 0) else f"{side}:{left},{right}"
    raise ValueError("attn_mask is not a CK mask (one run of keys per row, i + d - l <= j <= i + d + r with l, r the "
                     "same for every row, d = 0 or Sk - Sq): use fmha_fwd with a mask string, or torch's SDPA")


def _candidates(m: torch.Tensor, shift: int, lower: bool) -> list[int]:
    """Side lengths a window on the diagonal ``j = i + shift`` could have: the widest reach of any
    row to its left (or right) of that diagonal, and -1 (unlimited)."""
    rows = torch.nonzero(m.any(dim=1)).flatten()
    if len(rows) == 0:
        return [-1]
    sub = m[rows]
    first = sub.int().argmax(dim=1)
    last = sub.shape[1] - 1 - sub.flip(1).int().argmax(dim=1)
    side = int((rows + shift - first).max()) if lower else int((last - rows - shift).max())
    return [-1, max(side, 0)]


def sdpa(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """``torch.nn.functional.scaled_dot_product_attention`` for q, k, v ``[B, H, S, D]`` through
    ``torch.ops.fmha_iree.fmha_fwd`` (no dropout). ``enable_gqa`` as in torch: with it, ``Hq`` may
    be a multiple of ``Hk``; without it the head counts must match. ``attn_mask`` as in torch
    (broadcastable to ``[B, Hq, Sq, Sk]``): a boolean mask that is one CK window for every batch
    entry and head runs as that mask; any other boolean mask, and a float mask (added to the
    scores), as an elementwise bias (``bias``: a bias module, the mask read per tile). A row whose
    every key is masked gives 0 (torch: NaN)."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("sdpa takes q, k, v as 4-D [B, H, S, D] tensors")
    if not enable_gqa and q.shape[1] != k.shape[1]:
        raise ValueError(f"q has {q.shape[1]} heads and k {k.shape[1]}: pass enable_gqa=True (as in torch)")
    sq, sk = q.shape[2], k.shape[2]
    try:
        mask, bias = mask_of(attn_mask, bool(is_causal), sq, sk), None
    except ValueError:
        if not isinstance(attn_mask, torch.Tensor) or is_causal:
            raise
        mask, bias = "0", additive_bias(attn_mask, q.dtype)
    out, _ = torch.ops.fmha_iree.fmha_fwd(q, k, v, mask, scale, "bhsd", None, bias)
    return out


def additive_bias(attn_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A mask as torch's SDPA reads it (boolean: True attends; float: added to the scores) as a 4-D
    additive bias of ``dtype`` (0 or ``-inf`` for a boolean one)."""
    if attn_mask.ndim > 4 or attn_mask.ndim < 1:
        raise ValueError(f"attn_mask must broadcast to [B, H, Sq, Sk], got shape {list(attn_mask.shape)}")
    m = attn_mask.reshape((1,) * (4 - attn_mask.ndim) + tuple(attn_mask.shape))
    if m.dtype == torch.bool:
        return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(~m, float("-inf"))
    if not m.dtype.is_floating_point:
        raise ValueError(f"attn_mask must be boolean or floating point, got {m.dtype}")
    return m.to(dtype)
