"""A paged KV cache in group mode (FlashAttention's and CK's ``block_table`` / ``page_block_size``
convention): validation, and the keys each sequence uses gathered into packed K/V.

``k_cache`` / ``v_cache`` are ``[num_pages, page_size, Hk, D]``; ``block_table`` int32
``[B, max_pages]``; sequence ``b``'s key ``j`` (``j < seqlen_k[b]``) lives in page
``block_table[b, j // page_size]``, row ``j % page_size``. Entries of ``block_table`` past a
sequence's last page are not read (any value, e.g. -1).

On a module with ragged frames (``fmha_iree.frames``: CUDA modules, llvm-cpu builds of the GPU
formulation) the cache is read on the device: the frame's key gather takes each sequence's rows
from its pages (``frames.paged_bases``), host arrays or DeviceTensors alike. Elsewhere the used keys
are gathered on the host into a packed ``[sum(seqlen_k), Hk, D]`` copy that the tile plan reads
(host arrays only).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .plan import runs
from .operand import Operand, as_operand
from .spec import int_array, int_vector

__all__ = ["PagedCache", "check_paged"]


@dataclasses.dataclass(frozen=True)
class PagedCache:
    """A validated paged cache: the caches as given, their operands, the block table and each
    sequence's key count."""

    k_cache: object
    v_cache: object
    k: Operand
    v: Operand
    block_table: np.ndarray  # [B, max_pages]
    lens: np.ndarray  # [B] int64

    def rows(self) -> np.ndarray:
        """The flat cache row of every used key, sequence by sequence (the host gather's index;
        one entry per key, so made only where the keys are gathered on the host)."""
        page = self.page_size
        seq, j = runs(self.lens)
        return self.block_table[seq, j // page].astype(np.int64) * page + j % page

    @property
    def on_device(self) -> bool:
        return self.k.on_device

    @property
    def page_size(self) -> int:
        return int(self.k.array.shape[1])

    def flat(self, which: str):
        """The cache's array as ``[num_pages * page_size, Hk, D]`` rows (a view; a bf16 host cache as
        a torch bfloat16 tensor, since its array holds the int16 bits)."""
        o = self.k if which == "k" else self.v
        n, p, h, d = o.array.shape
        rows = o.array.reshape((n * p, h, d))
        if o.dtype == "bf16" and isinstance(rows, np.ndarray):
            import torch

            return torch.from_numpy(rows).view(torch.bfloat16)
        return rows

    def packed(self):
        """(k, v, seqstart_k): the used keys gathered on the host into packed ``[sum(seqlen_k), Hk,
        D]`` arrays (the inputs' array type: numpy, or torch CPU tensors) and int64 ``[B+1]``
        starts; host caches only."""
        if self.on_device:
            raise TypeError("k_cache: this module reads a paged cache from host arrays (torch CPU tensors or numpy); "
                            "got a DeviceTensor")
        starts = np.concatenate([[0], np.cumsum(self.lens)]).astype(np.int64)
        rows = self.rows()
        return _take(self.k_cache, self.k, rows), _take(self.v_cache, self.v, rows), starts


def check_paged(k_cache, v_cache, seqstart_q, seqstart_k, seqlen_k, seqstart_padded_k, block_table) -> PagedCache:
    """Validate a group-mode call's paged cache (every page a sequence reads inside the cache,
    seqlen_k within the table's capacity, host arrays or DeviceTensors for both caches)."""
    for name, val in (("seqstart_k", seqstart_k), ("seqstart_padded_k", seqstart_padded_k)):
        if val is not None:
            raise ValueError(f"{name} must be None with block_table (the pages and seqlen_k place the keys)")
    batch = len(int_vector(seqstart_q, "seqstart_q", None)) - 1
    if batch < 0:
        raise ValueError("seqstart_q must have at least one entry")
    ko, vo = _cache_operand(k_cache, "k_cache"), _cache_operand(v_cache, "v_cache")
    if ko.on_device != vo.on_device:
        raise TypeError("k_cache and v_cache must both be DeviceTensors or both host arrays, got "
                        f"{'a DeviceTensor' if ko.on_device else 'a host array'} k_cache")
    lens, bt = _used_pages(ko, vo, block_table, seqlen_k, batch)
    return PagedCache(k_cache, v_cache, ko, vo, bt, lens)


def _cache_operand(x, name: str) -> Operand:
    o = as_operand(x, name)
    if o.array.ndim != 4:
        raise ValueError(f"{name} must be 4-D [num_pages, page_size, Hk, D], got shape {list(o.array.shape)}")
    return o


def _block_table(block_table, batch: int) -> np.ndarray:
    bt = int_array(block_table, "block_table", " [B, max_pages]")
    if bt.ndim != 2 or bt.shape[0] != batch:
        raise ValueError(f"block_table must have shape [B={batch}, max_pages], got {list(bt.shape)}")
    return bt


def _used_pages(ko: Operand, vo: Operand, block_table, seqlen_k, batch: int):
    """(lens, block table), validated: every page a sequence reads is a page of the cache. The
    check runs over the table's entries (one per page, not per key: a decode batch's call checks
    ``B x max_pages`` entries, not its ``sum(seqlen_k)`` keys)."""
    n_pages, page, hk, _ = ko.array.shape
    if n_pages * page >= 2 ** 31:
        raise ValueError(f"k_cache holds {n_pages} x {page} rows: at most 2**31 - 1 rows are addressed")
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
    used = np.arange(bt.shape[1]) < -(-lens // page)[:, None]  # [B, max_pages]: pages with keys
    bad = used & ((bt < 0) | (bt >= n_pages))
    if bad.any():
        b, c = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"block_table[{b}, {c}] = {int(bt[b, c])} is not a page of k_cache (0..{n_pages - 1})")
    return lens, bt


def _take(x, o: Operand, flat: np.ndarray):
    """Rows ``flat`` of ``x`` seen as ``[num_pages * page_size, Hk, D]``, in ``x``'s array type."""
    n, p, h, d = o.array.shape
    if o.is_torch:
        import torch

        return x.detach().reshape(n * p, h, d)[torch.from_numpy(flat)]
    return o.array.reshape(n * p, h, d)[flat]
