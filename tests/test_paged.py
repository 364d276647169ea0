"""Group mode over a paged KV cache (``block_table``, FlashAttention's and CK's convention).

Sequence ``b``'s key ``j`` lives in page ``block_table[b, j // page_size]``, row ``j % page_size``
of ``k_cache`` / ``v_cache`` ``[num_pages, page_size, Hk, D]``, for ``j < seqlen_k[b]``. The
reference reads each key from its page with a plain Python loop and runs reference.py's float64
``attention_ref`` per sequence. Kernel key: the group-mode workhorse f32 g2 d64 (bshd).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fmha_iree
from common import compiles, set_policy, spy_calls
from reference import assert_close, attention_ref, seed_of

HQ, HK, D = 4, 2, 64


def _cache(seed, n_pages, page):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n_pages, page, HK, D, generator=g), torch.randn(n_pages, page, HK, D, generator=g))


def _table(seed, lens, page, n_pages, max_pages):
    """Each sequence's pages: distinct pages drawn at random, -1 past its last page."""
    rng = np.random.default_rng(seed)
    free = list(rng.permutation(n_pages))
    bt = np.full((len(lens), max_pages), -1, np.int32)
    for b, n in enumerate(lens):
        for i in range(-(-n // page)):
            bt[b, i] = free.pop()
    return torch.from_numpy(bt)


def _reference(q, k_cache, v_cache, sq, block_table, seqlen_k, mask):
    page = k_cache.shape[1]
    out = np.zeros((q.shape[0], HQ, D))
    lse = np.full((HQ, int(sq[-1])), -np.inf)
    for b in range(len(seqlen_k)):
        a, e = int(sq[b]), int(sq[b + 1])
        if e == a:
            continue
        keys = [(int(block_table[b, j // page]), j % page) for j in range(int(seqlen_k[b]))]
        kb = torch.stack([k_cache[p, r] for p, r in keys]) if keys else torch.zeros(0, HK, D)
        vb = torch.stack([v_cache[p, r] for p, r in keys]) if keys else torch.zeros(0, HK, D)
        o, lo = attention_ref(q[a:e][None], kb[None], vb[None], mask=mask, layout="bshd")
        out[a:e], lse[:, a:e] = o[0], lo[0]
    return out, lse


CASES = [  # (id, query lengths, key lengths, page size)
    ("decode-p16", [1, 1, 1, 1], [40, 1, 17, 130], 16),
    ("prefill-p64", [30, 7, 0, 100], [30, 200, 5, 100], 64),
    ("chunked-p256", [64, 3], [300, 3], 256),
    ("empty-p16", [2, 0, 5], [0, 0, 33], 16),
]


@pytest.mark.parametrize("mask", ["0", "b", "t:5,3"])
@pytest.mark.parametrize("name,lq,lk,page", CASES, ids=[c[0] for c in CASES])
def test_paged_matches_reference(name, lq, lk, page, mask):
    max_pages = max(-(-n // page) for n in lk) + 1
    n_pages = sum(-(-n // page) for n in lk) + 3  # unused pages too
    k_cache, v_cache = _cache(seed_of("paged", name), n_pages, page)
    bt = _table(seed_of("paged-table", name), lk, page, n_pages, max_pages)
    sq = torch.tensor(np.concatenate([[0], np.cumsum(lq)]), dtype=torch.int32)
    q = torch.randn(max(sum(lq), 1), HQ, D, generator=torch.Generator().manual_seed(seed_of("paged-q", name)))
    seqlen_k = torch.tensor(lk, dtype=torch.int32)
    out, lse = fmha_iree.fmha_fwd_varlen(q, k_cache, v_cache, sq, None, seqlen_k=seqlen_k, block_table=bt, mask=mask,
                                         return_lse=True)
    ref_out, ref_lse = _reference(q, k_cache, v_cache, sq, bt, seqlen_k, mask)
    assert_close(out, ref_out, torch.float32, what=f"{name} {mask} out")
    assert_close(lse, ref_lse, torch.float32, kind="lse", what=f"{name} {mask} lse")



@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_paged_half_precision(dtype):
    """f16 / bf16 caches (a bf16 cache's host array holds its int16 bits: it stays bf16 through the
    cache's flat view), decode and prefill sequences, scattered pages."""
    lq, lk, page = [1, 5, 0, 37], [40, 29, 12, 50], 16
    n_pages = sum(-(-n // page) for n in lk) + 2
    k_cache, v_cache = (x.to(dtype) for x in _cache(seed_of("paged-half", dtype), n_pages, page))
    bt = _table(seed_of("paged-half-table"), lk, page, n_pages, 4)
    q = torch.randn(sum(lq), HQ, D, generator=torch.Generator().manual_seed(7)).to(dtype)
    sq = torch.tensor(np.concatenate([[0], np.cumsum(lq)]), dtype=torch.int32)
    seqlen_k = torch.tensor(lk, dtype=torch.int32)
    out, lse = fmha_iree.fmha_fwd_varlen(q, k_cache, v_cache, sq, None, seqlen_k=seqlen_k, block_table=bt,
                                         mask="b", return_lse=True)
    assert out.dtype == dtype
    ref_out, ref_lse = _reference(q, k_cache, v_cache, sq, bt, seqlen_k, "b")
    assert_close(out, ref_out, dtype, kind="out", what=f"paged {dtype}")
    assert_close(lse, ref_lse, dtype, kind="lse", what=f"paged {dtype}")

def test_paged_numpy_inputs():
    k_cache, v_cache = _cache(seed_of("paged-np"), 6, 32)
    bt = _table(seed_of("paged-np-table"), [50, 20], 32, 6, 3)
    q = torch.randn(9, HQ, D, generator=torch.Generator().manual_seed(3))
    sq, lk = np.array([0, 4, 9], np.int32), np.array([50, 20], np.int32)
    out = fmha_iree.fmha_fwd_varlen(q.numpy(), k_cache.numpy(), v_cache.numpy(), sq, None, seqlen_k=lk,
                                    block_table=bt.numpy(), mask="b")
    assert isinstance(out, np.ndarray)
    assert_close(out, _reference(q, k_cache, v_cache, sq, bt, lk, "b")[0], np.float32, what="numpy paged")


def test_bad_paged_arguments_are_refused_before_compiling():
    k_cache, v_cache = _cache(seed_of("paged-bad"), 4, 16)
    q = torch.randn(3, HQ, D)
    sq = torch.tensor([0, 1, 3], dtype=torch.int32)
    lk = torch.tensor([10, 20], dtype=torch.int32)
    bt = torch.tensor([[0, -1], [1, 2]], dtype=torch.int32)

    def call(kv=(k_cache, v_cache), seqstart_k=None, **kw):
        return fmha_iree.fmha_fwd_varlen(q, *kv, sq, seqstart_k, **{"seqlen_k": lk, "block_table": bt, **kw})

    before = compiles()
    bad = [
        (dict(block_table=torch.tensor([[5, -1], [1, 2]], dtype=torch.int32)), ValueError, "block_table"),
        (dict(block_table=torch.tensor([[0, -1], [1, -2]], dtype=torch.int32)), ValueError, r"block_table\[1, 1\] = -2"),
        (dict(block_table=bt[:1]), ValueError, "block_table"),
        (dict(block_table=bt.float()), TypeError, "block_table"),
        (dict(seqlen_k=torch.tensor([10, 40], dtype=torch.int32)), ValueError, "seqlen_k"),
        (dict(seqlen_k=None), ValueError, "seqlen_k"),
        (dict(seqstart_k=sq), ValueError, "seqstart_k"),
        (dict(kv=(k_cache[0], v_cache[0])), ValueError, "k_cache"),
        (dict(kv=(k_cache, v_cache[:, :8])), ValueError, "v_cache"),
        (dict(kv=(fmha_iree.to_device(k_cache), v_cache)), TypeError, "k_cache"),
    ]
    for kw, exc, word in bad:
        with pytest.raises(exc, match=word):
            call(**kw)
    assert compiles() == before


@pytest.mark.parametrize("page", [16, 64])
def test_cpu_decode_reads_pages_in_place(monkeypatch, page):
    """A CPU decode batch over a paged cache runs ``rows_packed_pages`` (the pages read through the
    block table, nothing gathered on the host): several groups of similar key counts, NaN in every
    free page and -1 in the table past each sequence's pages, against the float64 reference."""
    from fmha_iree.runtime.module import Upload

    set_policy(monkeypatch, GROUP_KEYS=64)  # several rows calls at these sizes
    calls = spy_calls(monkeypatch)
    lk = [1, 200, 17, 64, 65, 130, 3, 90]
    max_pages = max(-(-n // page) for n in lk) + 2
    n_pages = sum(-(-n // page) for n in lk) + 4
    k_cache, v_cache = _cache(seed_of("paged-rows", page), n_pages, page)
    bt = _table(seed_of("paged-rows-table", page), lk, page, n_pages, max_pages)
    used = set(int(x) for x in bt.flatten() if x >= 0)
    for pg in set(range(n_pages)) - used:
        k_cache[pg], v_cache[pg] = float("nan"), float("nan")
    for b, n in enumerate(lk):  # rows of a sequence's last page past its keys
        last = int(bt[b, (n - 1) // page])
        k_cache[last, (n - 1) % page + 1:] = float("nan")
        v_cache[last, (n - 1) % page + 1:] = float("nan")
    sq = torch.arange(len(lk) + 1, dtype=torch.int32)
    q = torch.randn(len(lk), HQ, D, generator=torch.Generator().manual_seed(seed_of("paged-rows-q", page)))
    seqlen_k = torch.tensor(lk, dtype=torch.int32)
    r = fmha_iree.route(q, k_cache, v_cache, seqstart_q=sq, seqlen_k=seqlen_k, block_table=bt, mask="b",
                        return_lse=True)
    assert (r.mode, r.path, r.entry) == ("paged", "cpu_pages", "rows_packed_pages"), str(r)
    out, lse = fmha_iree.fmha_fwd_varlen(q, k_cache, v_cache, sq, None, seqlen_k=seqlen_k, block_table=bt, mask="b",
                                         return_lse=True)
    fns = [fn for fn, _, _ in calls]
    assert len(fns) > 1 and set(fns) == {"rows_packed_pages"}, ("the pages are read in place, in several calls", fns)
    tables = [args[-1] for _, args, _ in calls]  # each call's block table, its last argument
    assert all(isinstance(t, Upload) and t.array.shape[1] == bt.shape[1] for t in tables), tables
    ref_out, ref_lse = _reference(q, k_cache, v_cache, sq, bt, seqlen_k, "b")
    assert not torch.isnan(out).any()
    assert_close(out, ref_out, torch.float32, what=f"page {page} out")
    assert_close(lse, ref_lse, torch.float32, kind="lse", what=f"page {page} lse")
