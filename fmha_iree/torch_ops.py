"""torch-native entry points: ``torch.ops.fmha_iree.fmha_fwd`` (a ``torch.library`` custom op with a
fake kernel, so ``torch.compile(fullgraph=True)`` and ``torch.export`` see through it) and
:func:`sdpa`, a drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

Importing this module registers the op (``import fmha_iree.torch_ops``); nothing else in the
package imports torch at import time. Torch tensors on the CPU only, as :func:`fmha_iree.fmha_fwd`
takes them today (their data goes through host memory).
"""

from __future__ import annotations

import torch

from .api import fmha_fwd

__all__ = ["sdpa", "mask_of"]


@torch.library.custom_op("fmha_iree::fmha_fwd", mutates_args=())
def _fmha_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: str, scale: float | None,
                 layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = fmha_fwd(q, k, v, mask=mask, scale=scale, layout=layout, return_lse=True)
    return out, lse


@_fmha_fwd_op.register_fake
def _(q, k, v, mask, scale, layout):
    b, x1, x2, _ = q.shape
    hq, sq = (x1, x2) if layout == "bhsd" else (x2, x1)
    return q.new_empty(q.shape[:3] + (v.shape[-1],)), q.new_empty((b, hq, sq), dtype=torch.float32)


def mask_of(attn_mask: torch.Tensor | None, is_causal: bool, sq: int, sk: int) -> str:
    """The CK mask string of torch's ``attn_mask`` / ``is_causal`` (torch's ``is_causal`` is
    top-left: row i sees keys j <= i). A boolean ``attn_mask`` shared by every batch and head is
    taken when each row's visible keys form one run ``i - l <= j <= i + r`` with the same ``l``,
    ``r`` for every row; anything else is a ``ValueError`` naming ``attn_mask``."""
    if attn_mask is None:
        return "t" if is_causal else "0"
    if is_causal:
        raise ValueError("attn_mask and is_causal cannot both be given (as in torch)")
    if not isinstance(attn_mask, torch.Tensor) or attn_mask.dtype != torch.bool:
        raise ValueError("attn_mask: only boolean masks are taken (additive float masks are not)")
    m = attn_mask
    while m.ndim > 2 and m.shape[0] == 1:
        m = m[0]
    if m.ndim != 2 or tuple(m.shape) != (sq, sk):
        raise ValueError(f"attn_mask must be [Sq, Sk] = [{sq}, {sk}] for every batch and head, got "
                         f"{list(attn_mask.shape)}")
    return _window(m.cpu(), sq, sk)


def _window(m: torch.Tensor, sq: int, sk: int) -> str:
    """``t:l,r`` for a boolean [Sq, Sk] mask that is a window (``-1``: unlimited side)."""
    if bool(m.all()):
        return "0"
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    for left in _candidates(m, i, j, lower=True):
        for right in _candidates(m, i, j, lower=False):
            vis = torch.ones(sq, sk, dtype=torch.bool)
            if left >= 0:
                vis &= j >= i - left
            if right >= 0:
                vis &= j <= i + right
            if torch.equal(vis, m):
                return f"t:{left},{right}"
    raise ValueError("attn_mask is not a CK mask (one run of keys per row, i - l <= j <= i + r with l, r the same "
                     "for every row): use fmha_fwd with a mask string, or torch's SDPA")


def _candidates(m: torch.Tensor, i, j, lower: bool) -> list[int]:
    """Side lengths a window could have: the widest reach of any row to its left (or right) of
    the diagonal, and -1 (unlimited)."""
    rows = torch.nonzero(m.any(dim=1)).flatten()
    if len(rows) == 0:
        return [-1]
    sub = m[rows]
    first = sub.int().argmax(dim=1)
    last = sub.shape[1] - 1 - sub.flip(1).int().argmax(dim=1)
    side = int((rows - first).max()) if lower else int((last - rows).max())
    return [-1, max(side, 0)]


def sdpa(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """``torch.nn.functional.scaled_dot_product_attention`` for q, k, v ``[B, H, S, D]`` through
    ``torch.ops.fmha_iree.fmha_fwd`` (no dropout). ``enable_gqa`` as in torch: with it, ``Hq`` may
    be a multiple of ``Hk``; without it the head counts must match."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("sdpa takes q, k, v as 4-D [B, H, S, D] tensors")
    if not enable_gqa and q.shape[1] != k.shape[1]:
        raise ValueError(f"q has {q.shape[1]} heads and k {k.shape[1]}: pass enable_gqa=True (as in torch)")
    mask = mask_of(attn_mask, bool(is_causal), q.shape[2], k.shape[2])
    out, _ = torch.ops.fmha_iree.fmha_fwd(q, k, v, mask, scale, "bhsd")
    return out
