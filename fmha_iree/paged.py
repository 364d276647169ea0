"""A paged KV cache in group mode (FlashAttention's and CK's ``block_table`` / ``page_block_size``
convention): validation, and the keys each sequence uses gathered into packed K/V.

``k_cache`` / ``v_cache`` are ``[num_pages, page_size, Hk, D]``; ``block_table`` int32
``[B, max_pages]``; sequence ``b``'s key ``j`` (``j < seqlen_k[b]``) lives in page
``block_table[b, j // page_size]``, row ``j % page_size``. Entries of ``block_table`` past a
sequence's last page are not read (any value, e.g. -1).

Today the used keys are gathered on the host into a packed ``[sum(seqlen_k), Hk, D]`` copy that
the group-mode path then reads (host arrays only): the semantics are complete, the cache is not yet
read in place by the kernels.
"""

from __future__ import annotations

import numpy as np

from .spec import Operand, as_operand, int_array, int_vector

__all__ = ["gather_pages", "paged_args"]


def _cache_operand(x, name: str) -> Operand:
    o = as_operand(x, name)
    if o.on_device:
        raise TypeError(f"{name}: a paged cache is read from host arrays (torch CPU tensors or numpy) for now; "
                        "got a DeviceTensor")
    if o.array.ndim != 4:
        raise ValueError(f"{name} must be 4-D [num_pages, page_size, Hk, D], got shape {list(o.array.shape)}")
    return o


def _block_table(block_table, batch: int) -> np.ndarray:
    bt = int_array(block_table, "block_table", " [B, max_pages]")
    if bt.ndim != 2 or bt.shape[0] != batch:
        raise ValueError(f"block_table must have shape [B={batch}, max_pages], got {list(bt.shape)}")
    return bt


def gather_pages(k_cache, v_cache, block_table, seqlen_k, batch: int):
    """Validate a paged cache for ``batch`` sequences; return (packed k, packed v, seqstart_k) as
    the group-mode arguments: ``[sum(seqlen_k), Hk, D]`` arrays (the inputs' array type: numpy,
    or torch CPU tensors) and int64 ``[B+1]`` starts."""
    ko, vo = _cache_operand(k_cache, "k_cache"), _cache_operand(v_cache, "v_cache")
    n_pages, page, hk, _ = ko.array.shape
    if vo.array.shape[:3] != (n_pages, page, hk):
        raise ValueError(f"v_cache {list(vo.array.shape)} must match k_cache {list(ko.array.shape)} in pages, "
                         "page size and heads")
    if seqlen_k is None:
        raise ValueError("seqlen_k [B] is required with block_table (the keys each sequence uses)")
    lens = int_vector(seqlen_k, "seqlen_k", batch)
    bt = _block_table(block_table, batch)
    if (lens < 0).any() or (lens > bt.shape[1] * page).any():
        b = int(np.argmax((lens < 0) | (lens > bt.shape[1] * page)))
        raise ValueError(f"seqlen_k[{b}] = {int(lens[b])} is outside [0, {bt.shape[1] * page}] "
                         f"(max_pages {bt.shape[1]} x page_size {page})")
    rows = [np.arange(n) for n in lens.tolist()]
    seq = np.repeat(np.arange(batch), lens)
    j = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    pages = bt[seq, j // page] if len(j) else np.zeros(0, np.int64)
    if ((pages < 0) | (pages >= n_pages)).any():
        i = int(np.argmax((pages < 0) | (pages >= n_pages)))
        raise ValueError(f"block_table[{int(seq[i])}, {int(j[i] // page)}] = {int(pages[i])} is not a page of "
                         f"k_cache (0..{n_pages - 1})")
    flat = pages * page + j % page
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    return _take(k_cache, ko, flat), _take(v_cache, vo, flat), starts


def _take(x, o: Operand, flat: np.ndarray):
    """Rows ``flat`` of ``x`` seen as ``[num_pages * page_size, Hk, D]``, in ``x``'s array type."""
    n, p, h, d = o.array.shape
    if o.is_torch:
        import torch

        return x.detach().reshape(n * p, h, d)[torch.from_numpy(flat)]
    return o.array.reshape(n * p, h, d)[flat]


def paged_args(k, v, seqstart_q, seqstart_k, seqlen_k, seqstart_padded_k, block_table):
    """The group-mode (k, v, seqstart_k, seqlen_k) of a call with a paged cache: packed K/V and
    their starts, every key of them used."""
    for name, val in (("seqstart_k", seqstart_k), ("seqstart_padded_k", seqstart_padded_k)):
        if val is not None:
            raise ValueError(f"{name} must be None with block_table (the pages and seqlen_k place the keys)")
    batch = len(int_vector(seqstart_q, "seqstart_q", None)) - 1
    if batch < 0:
        raise ValueError("seqstart_q must have at least one entry")
    k, v, starts = gather_pages(k, v, block_table, seqlen_k, batch)
    return k, v, starts, None

