"""Group mode (varlen): fmha_fwd_varlen with sequences packed along the token axis.

Semantics from /work/shared/docs/ck-fmha-reference.md ("Modes", "Masks"): sequence ``b`` has
``seqstart_q[b+1]-seqstart_q[b]`` queries and ``seqstart_k[b+1]-seqstart_k[b]`` keys (of which the
first ``seqlen_k[b]`` are used when given); its rows live at ``seqstart_padded_*[b]`` when padded
starts are given; the mask is applied per sequence with that sequence's own lengths; LSE is
``[Hq, total_q]`` indexed by the unpadded query start; rows owned by no sequence are 0.

The reference (``varlen_ref`` below) slices each sequence out of the packed tensors and runs
reference.py's float64 ``attention_ref`` on it (bshd, B=1): nothing here is checked against
fmha_iree itself.

Kernel keys (dtype, Hq//Hk, Dq, Dv), at most 6 compiled:
  f32 g2 d64x64 (the workhorse), f32 g1 d64x64, f32 g4 d64x64, f32 g2 d32x64,
  f16 g2 d64x64, bf16 g2 d64x64.
The bad-input tests use f32 g2 d16x16, which nothing compiles (validation precedes compiling).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fmha_iree
from reference import assert_close, ints, make_qkv, seed_of, to_f64, varlen_ref

D = 64
MASKS = ["0", "b", "t", "b:16,0", "t:3,5", "xb:9"]


# --------------------------------------------------------------------------------------------
# Reference and helpers
# --------------------------------------------------------------------------------------------
def starts(lengths, gaps=None) -> torch.Tensor:
    """int32 [B+1] cumulative starts; with ``gaps``, gap[b] free rows precede sequence b
    (and gaps[B], if present, trail the last one)."""
    lengths = list(lengths)
    s, pos = [], 0
    for b, n in enumerate(lengths):
        if gaps is not None:
            pos += gaps[b]
        s.append(pos)
        pos += n
    if gaps is not None and len(gaps) > len(lengths):
        pos += gaps[len(lengths)]
    s.append(pos)
    return torch.tensor(s, dtype=torch.int32)


def packed(seed, tq, tk, *, Hq=2, Hk=1, Dq=D, Dv=None, dtype=torch.float32):
    """Random packed q [tq, Hq, Dq], k [tk, Hk, Dq], v [tk, Hk, Dv] from reference.make_qkv."""
    q, k, v = make_qkv(seed, B=1, Hq=Hq, Hk=Hk, Sq=max(tq, 1), Sk=max(tk, 1), Dq=Dq, Dv=Dv,
                       dtype=dtype, layout="bshd")
    return (q[0, :tq].contiguous(), k[0, :tk].contiguous(), v[0, :tk].contiguous())


def owned_rows(lengths, phys_starts, total) -> np.ndarray:
    own = np.zeros(total, dtype=bool)
    for n, s in zip(lengths, ints(phys_starts)[:-1]):
        own[int(s):int(s) + n] = True
    return own


def check_varlen(q, k, v, seqstart_q, seqstart_k, *, what="", **kw):
    """Run fmha_fwd_varlen(return_lse=True) and compare out and lse with varlen_ref."""
    res = fmha_iree.fmha_fwd_varlen(q, k, v, seqstart_q, seqstart_k, return_lse=True, **kw)
    assert isinstance(res, tuple) and len(res) == 2, "return_lse=True must give (out, lse)"
    out, lse = res
    ref_kw = {n: kw[n] for n in ("seqlen_k", "seqstart_padded_q", "seqstart_padded_k", "mask",
                                  "scale") if n in kw}
    ref_out, ref_lse = varlen_ref(q, k, v, seqstart_q, seqstart_k, **ref_kw)
    if isinstance(q, torch.Tensor):
        assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)
        assert lse.dtype == torch.float32, f"lse dtype {lse.dtype}"
    else:
        assert isinstance(out, np.ndarray) and isinstance(lse, np.ndarray)
        assert lse.dtype == np.float32, f"lse dtype {lse.dtype}"
    assert out.dtype == q.dtype, f"out dtype {out.dtype} != input {q.dtype}"
    assert tuple(out.shape) == ref_out.shape, f"out shape {tuple(out.shape)} != {ref_out.shape}"
    assert tuple(lse.shape) == ref_lse.shape, f"lse shape {tuple(lse.shape)} != {ref_lse.shape}"
    assert_close(out, ref_out, q.dtype, kind="out", what=what)
    assert_close(lse, ref_lse, q.dtype, kind="lse", what=what)
    return out, lse, ref_out, ref_lse


# --------------------------------------------------------------------------------------------
# Many short + a few long sequences, every mask (workhorse key f32 g2 d64)
# --------------------------------------------------------------------------------------------
# (id, query lengths, key lengths): Sq != Sk per sequence, lengths crossing 128-row tiles.
MIXED = [
    ("short-long", [1, 7, 77, 130, 300, 3, 2, 12], [1, 9, 60, 150, 260, 3, 40, 12]),
    ("q-longer", [130, 5, 1, 200, 9], [20, 5, 129, 70, 1]),
]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("name,lq,lk", MIXED, ids=[c[0] for c in MIXED])
def test_mixed_lengths(name, lq, lk, mask):
    q, k, v = packed(seed_of("varlen-mixed", name, mask), sum(lq), sum(lk))
    check_varlen(q, k, v, starts(lq), starts(lk), mask=mask, what=f"{name} mask={mask}")



@pytest.mark.parametrize("mask", ["b", "t:3,5", "0"])
def test_plan_in_state_blocks(monkeypatch, mask):
    """Sequences through the tile plan with its state cut into blocks of 8 tiles (the smallest the
    budget allows at 8 query heads, ``plan.state_tiles``) equal the float64 reference; the
    sequences' 16 tiles make two blocks."""
    from fmha_iree.problem import plan as plan_mod

    monkeypatch.setitem(plan_mod.STATE_BUDGET, "cpu", 1)
    lq, lk = [600, 130, 1, 0, 900, 70], [600, 200, 5, 3, 850, 70]
    q, k, v = packed(seed_of("varlen-blocks", mask), sum(lq), sum(lk), Hq=8, Hk=4)
    check_varlen(q, k, v, starts(lq), starts(lk), mask=mask, what=f"blocks mask={mask}")

def test_many_length_one_sequences():
    """40 sequences of 1 query each, key counts 1..40; 'b' lets each query see all its keys,
    't' only its first key."""
    lq = [1] * 40
    lk = list(range(1, 41))
    q, k, v = packed(seed_of("varlen-len1"), sum(lq), sum(lk))
    for mask in ("0", "b", "t"):
        check_varlen(q, k, v, starts(lq), starts(lk), mask=mask, what=f"len1 mask={mask}")


def test_single_sequence_matches_whole_problem():
    """B=1 group mode is plain attention over the whole packed tensor."""
    q, k, v = packed(seed_of("varlen-single"), 150, 170)
    check_varlen(q, k, v, starts([150]), starts([170]), mask="b", what="single")


# --------------------------------------------------------------------------------------------
# Zero-length sequences and -inf LSE rows
# --------------------------------------------------------------------------------------------
# (id, query lengths, key lengths)
ZERO = [
    ("no-queries", [0, 5, 0, 130, 0], [7, 5, 3, 140, 9]),
    ("no-keys", [4, 130, 3, 1], [0, 0, 6, 0]),
    ("both-empty", [0, 6, 0, 0], [0, 8, 0, 5]),
    ("all-empty-q", [0, 0], [3, 4]),
]


@pytest.mark.parametrize("mask", ["0", "b", "t", "b:16,0"])
@pytest.mark.parametrize("name,lq,lk", ZERO, ids=[c[0] for c in ZERO])
def test_zero_length_sequences(name, lq, lk, mask):
    q, k, v = packed(seed_of("varlen-zero", name, mask), sum(lq), sum(lk))
    out, lse, _, _ = check_varlen(q, k, v, starts(lq), starts(lk), mask=mask,
                                  what=f"{name} mask={mask}")
    assert tuple(lse.shape) == (2, sum(lq))
    sq = starts(lq).tolist()
    for b, (nq, nk) in enumerate(zip(lq, lk)):
        if nk == 0 and nq > 0:
            rows = slice(sq[b], sq[b] + nq)
            assert (out[rows] == 0).all(), f"sequence {b} has no keys: out must be 0"
            assert torch.isneginf(lse[:, rows]).all(), f"sequence {b} has no keys: lse -inf"


def test_bottom_right_rows_without_keys_are_neg_inf():
    """'b' with Sq_b > Sk_b: the first Sq_b-Sk_b rows of that sequence see nothing (0, -inf),
    the mask uses each sequence's own lengths (not the packed totals)."""
    lq, lk = [10, 3, 140], [4, 3, 131]
    q, k, v = packed(seed_of("varlen-br-inf"), sum(lq), sum(lk))
    out, lse, _, ref_lse = check_varlen(q, k, v, starts(lq), starts(lk), mask="b", what="br")
    assert torch.isneginf(lse[:, 0:6]).all() and torch.isfinite(lse[:, 6:10]).all()
    assert (out[0:6] == 0).all()
    assert torch.isfinite(lse[:, 10:13]).all()
    assert torch.isneginf(lse[:, 13:13 + 9]).all() and torch.isfinite(lse[:, 22:]).all()
    assert np.isneginf(ref_lse).sum() == 2 * (6 + 9)


# --------------------------------------------------------------------------------------------
# seqlen_k and padded starts (padding is filled with NaN: it must never be read)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mask", ["0", "b", "t", "t:3,5", "xb:9"])
def test_seqlen_k(mask):
    lq = [5, 1, 130, 7, 3, 0]
    lk = [20, 4, 140, 7, 9, 5]  # keys each sequence holds
    used = [13, 0, 129, 7, 1, 2]  # keys actually used (first ones)
    # the unused key tails hold ordinary finite data: using any of them shows as an error
    # (garbage there is test_unused_rows_are_never_read's business)
    q, k, v = packed(seed_of("varlen-seqlen_k", mask), sum(lq), sum(lk))
    seqlen_k = torch.tensor(used, dtype=torch.int32)
    out, lse, _, _ = check_varlen(q, k, v, starts(lq), starts(lk), seqlen_k=seqlen_k, mask=mask,
                                  what=f"seqlen_k mask={mask}")
    # sequence 1 uses no keys: its one query row is 0 / -inf
    sq = starts(lq).tolist()
    assert (out[sq[1]] == 0).all() and torch.isneginf(lse[:, sq[1]]).all()


def test_seqlen_k_changes_bottom_right_alignment():
    """Bottom-right aligns the last query with the last USED key: with Sq=4, seqlen_k=6 row i sees
    keys j <= i + 2 (not i + Sk_held - 4)."""
    lq, lk, used = [4], [10], [6]
    q, k, v = packed(seed_of("varlen-seqlen_k-br"), 4, 10)
    out, lse, _, _ = check_varlen(q, k, v, starts(lq), starts(lk),
                                  seqlen_k=torch.tensor(used, dtype=torch.int32), mask="b",
                                  what="seqlen_k br")
    # an independent spot check of the alignment: row 0 sees exactly keys 0..2
    q64, k64, v64 = to_f64(q), to_f64(k), to_f64(v)
    s = (q64[0, 0] @ k64[:3, 0].T) / np.sqrt(D)
    p = np.exp(s - s.max())
    np.testing.assert_allclose(to_f64(out[0, 0]), (p / p.sum()) @ v64[:3, 0], atol=2e-5, rtol=2e-5)


PADDED = [
    # (id, query lengths, key lengths, q gaps (B+1) or None, k gaps (B+1) or None, seqlen_k)
    ("q-and-k", [5, 130, 0, 7, 1], [9, 140, 4, 3, 1], [3, 0, 17, 2, 5, 4], [0, 6, 1, 130, 2, 3],
     None),
    ("q-only", [5, 77, 1], [5, 80, 2], [2, 9, 1, 11], None, None),
    ("k-only", [6, 3, 129], [12, 3, 129], None, [4, 4, 4, 0], None),
    ("with-seqlen_k", [4, 2, 130], [10, 8, 135], [1, 3, 5, 2], [2, 0, 7, 3], [7, 8, 128]),
]


@pytest.mark.parametrize("mask", ["0", "b", "t", "b:16,0", "xb:9"])
@pytest.mark.parametrize("name,lq,lk,gq,gk,used", PADDED, ids=[c[0] for c in PADDED])
def test_padded_starts(name, lq, lk, gq, gk, used, mask):
    pq = starts(lq, gq) if gq is not None else None
    pk = starts(lk, gk) if gk is not None else None
    tq = int(pq[-1]) if pq is not None else sum(lq)
    tk = int(pk[-1]) if pk is not None else sum(lk)
    # gap rows hold ordinary finite data here (garbage: test_unused_rows_are_never_read)
    q, k, v = packed(seed_of("varlen-padded", name, mask), tq, tk)
    own_q = owned_rows(lq, pq if pq is not None else starts(lq), tq)
    kw = dict(mask=mask)
    if pq is not None:
        kw["seqstart_padded_q"] = pq
    if pk is not None:
        kw["seqstart_padded_k"] = pk
    if used is not None:
        kw["seqlen_k"] = torch.tensor(used, dtype=torch.int32)
    out, lse, _, _ = check_varlen(q, k, v, starts(lq), starts(lk), what=f"{name} mask={mask}",
                                  **kw)
    assert tuple(out.shape) == (tq, 2, D)
    assert tuple(lse.shape) == (2, sum(lq)), "lse is indexed by the unpadded starts"
    gap = torch.from_numpy(~own_q)
    assert (out[gap] == 0).all(), "rows owned by no sequence must be 0"


GARBAGE = [(t, f) for t in ("q", "k", "v") for f in ("nan", "inf")]


@pytest.mark.parametrize("tensor,fill", GARBAGE, ids=[f"{t}-{f}" for t, f in GARBAGE])
def test_unused_rows_are_never_read(tensor, fill):
    """NaN / inf in rows no sequence uses (padded gaps, including a trailing one, and key tails
    past seqlen_k) must not reach out or lse: a KV cache's unused slots may hold anything."""
    lq, lk, used = [5, 130, 3], [20, 140, 9], [13, 129, 9]
    pq, pk = starts(lq, [2, 3, 0, 4]), starts(lk, [0, 5, 2, 6])
    tq, tk = int(pq[-1]), int(pk[-1])
    q, k, v = packed(seed_of("varlen-garbage", tensor, fill), tq, tk)
    own = {"q": owned_rows(lq, pq, tq), "k": owned_rows(used, pk, tk)}
    own["v"] = own["k"]
    x = {"q": q, "k": k, "v": v}[tensor]
    x[torch.from_numpy(~own[tensor])] = float(fill)
    seqlen_k = torch.tensor(used, dtype=torch.int32)
    out, lse, _, _ = check_varlen(q, k, v, starts(lq), starts(lk), seqstart_padded_q=pq,
                                  seqstart_padded_k=pk, seqlen_k=seqlen_k, mask="b",
                                  what=f"{tensor}={fill} in unused rows")
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert (out[torch.from_numpy(~own["q"])] == 0).all()


# --------------------------------------------------------------------------------------------
# GQA / MQA, head dims, dtypes, numpy, scale
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hq,hk", [(4, 2), (4, 1), (2, 2)], ids=["g2-4x2", "mqa-4x1", "mha-2x2"])
@pytest.mark.parametrize("mask", ["0", "b", "t:3,5"])
def test_gqa(hq, hk, mask):
    lq, lk = [3, 130, 1, 20], [5, 129, 0, 33]
    q, k, v = packed(seed_of("varlen-gqa", hq, hk, mask), sum(lq), sum(lk), Hq=hq, Hk=hk)
    check_varlen(q, k, v, starts(lq), starts(lk), mask=mask, what=f"{hq}x{hk} mask={mask}")


@pytest.mark.parametrize("mask", ["0", "b"])
def test_dq_ne_dv(mask):
    lq, lk = [7, 130, 2], [9, 131, 40]
    q, k, v = packed(seed_of("varlen-dqdv", mask), sum(lq), sum(lk), Dq=32, Dv=64)
    out, _, _, _ = check_varlen(q, k, v, starts(lq), starts(lk), mask=mask, what="dq32 dv64")
    assert tuple(out.shape) == (sum(lq), 2, 64)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("mask", ["0", "b", "t:3,5"])
def test_dtypes(dtype, mask):
    lq, lk = [1, 7, 77, 130, 0, 4], [1, 9, 60, 150, 3, 0]
    gq, gk = [2, 0, 5, 1, 0, 3, 1], [0, 3, 0, 4, 2, 1, 0]
    pq, pk = starts(lq, gq), starts(lk, gk)
    q, k, v = packed(seed_of("varlen-dtype", str(dtype), mask), int(pq[-1]), int(pk[-1]),
                     dtype=dtype)
    out, lse, _, _ = check_varlen(q, k, v, starts(lq), starts(lk), seqstart_padded_q=pq,
                                  seqstart_padded_k=pk, mask=mask, what=f"{dtype} mask={mask}")
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert (out[torch.from_numpy(~owned_rows(lq, pq, int(pq[-1])))] == 0).all()
    sq = starts(lq).tolist()
    assert torch.isneginf(lse[:, sq[5]:sq[6]]).all(), "a sequence without keys gives lse -inf"


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["np-f32", "np-f16"])
def test_numpy_inputs(dtype):
    lq, lk = [3, 130, 5], [4, 140, 0]
    q, k, v = packed(seed_of("varlen-numpy", str(dtype)), sum(lq), sum(lk))
    q, k, v = (x.numpy().astype(dtype) for x in (q, k, v))
    sq = np.array(starts(lq).tolist(), dtype=np.int32)
    sk = np.array(starts(lk).tolist(), dtype=np.int32)
    out, lse, _, _ = check_varlen(q, k, v, sq, sk, mask="b",
                                  seqlen_k=np.array([4, 139, 0], dtype=np.int32),
                                  what=f"numpy {dtype}")
    assert isinstance(out, np.ndarray) and out.dtype == dtype


def test_scale_and_return_lse_false():
    lq, lk = [9, 130], [12, 128]
    q, k, v = packed(seed_of("varlen-scale"), sum(lq), sum(lk))
    check_varlen(q, k, v, starts(lq), starts(lk), mask="t", scale=0.3, what="scale")
    out = fmha_iree.fmha_fwd_varlen(q, k, v, starts(lq), starts(lk), mask="t", scale=0.3)
    assert isinstance(out, torch.Tensor) and tuple(out.shape) == (sum(lq), 2, D)
    ref_out, _ = varlen_ref(q, k, v, starts(lq), starts(lk), mask="t", scale=0.3)
    assert_close(out, ref_out, torch.float32, what="return_lse=False")


# --------------------------------------------------------------------------------------------
# One module serves every batch composition
# --------------------------------------------------------------------------------------------
def test_no_recompile_across_batch_compositions():
    q, k, v = packed(seed_of("varlen-nocompile-warm"), 5, 6)
    fmha_iree.fmha_fwd_varlen(q, k, v, starts([5]), starts([6]), return_lse=True)
    stats0 = fmha_iree.cache_stats()
    # (query lengths, key lengths, mask, extra) -- B, lengths, masks, padding, seqlen_k all vary
    comps = [
        ([1], [1], "0", {}),
        ([300, 2, 130], [7, 260, 131], "b", {}),
        ([0] * 5 + [129] + [1] * 30, [3] * 5 + [257] + list(range(30)), "t:3,5", {}),
        ([77, 0, 12], [0, 90, 12], "xb:9", {"seqlen_k": [0, 45, 12]}),
        ([6, 20], [10, 30], "t", {"pad_q": [1, 2, 3], "pad_k": [4, 0, 1]}),
        ([128] * 4, [128] * 4, "b:16,0", {}),
    ]
    for i, (lq, lk, mask, extra) in enumerate(comps):
        kw = dict(mask=mask)
        tq, tk = sum(lq), sum(lk)
        if "seqlen_k" in extra:
            kw["seqlen_k"] = torch.tensor(extra["seqlen_k"], dtype=torch.int32)
        if "pad_q" in extra:
            kw["seqstart_padded_q"] = starts(lq, extra["pad_q"])
            tq = int(kw["seqstart_padded_q"][-1])
        if "pad_k" in extra:
            kw["seqstart_padded_k"] = starts(lk, extra["pad_k"])
            tk = int(kw["seqstart_padded_k"][-1])
        q, k, v = packed(seed_of("varlen-nocompile", i), tq, tk)
        check_varlen(q, k, v, starts(lq), starts(lk), what=f"composition {i}", **kw)
        stats = fmha_iree.cache_stats()
        assert stats["compiles"] == stats0["compiles"], f"composition {i} compiled a new module"
        assert stats.get("disk_hits") == stats0.get("disk_hits"), \
            f"composition {i} loaded another module from disk"


# --------------------------------------------------------------------------------------------
# Bad input: ValueError naming the argument, before any compile
# --------------------------------------------------------------------------------------------
def i32(*vals):
    return torch.tensor(vals, dtype=torch.int32)


def _bad_qkv():
    # f32, g2, d16x16: a key that no valid call in this suite compiles
    return packed(seed_of("varlen-errors"), 10, 12, Hq=2, Hk=1, Dq=16, Dv=16)


# (id, seqstart_q, seqstart_k, kwargs, argument the message must name)
BAD = [
    ("sq-nonzero-start", i32(1, 5, 10), i32(0, 6, 12), {}, "seqstart_q"),
    ("sk-nonzero-start", i32(0, 5, 10), i32(2, 6, 12), {}, "seqstart_k"),
    ("sq-non-monotonic", i32(0, 6, 4, 10), i32(0, 4, 8, 12), {}, "seqstart_q"),
    ("sk-non-monotonic", i32(0, 4, 8, 10), i32(0, 7, 5, 12), {}, "seqstart_k"),
    ("sq-past-tensor", i32(0, 5, 11), i32(0, 6, 12), {}, "seqstart_q"),
    ("sk-past-tensor", i32(0, 5, 10), i32(0, 6, 13), {}, "seqstart_k"),
    ("lengths-differ", i32(0, 5, 10), i32(0, 4, 8, 12), {}, r"seqstart_[qk]"),
    ("seqlen_k-too-long", i32(0, 5, 10), i32(0, 6, 12), {"seqlen_k": i32(6, 7)}, "seqlen_k"),
    ("seqlen_k-negative", i32(0, 5, 10), i32(0, 6, 12), {"seqlen_k": i32(-1, 3)}, "seqlen_k"),
    ("seqlen_k-wrong-length", i32(0, 5, 10), i32(0, 6, 12), {"seqlen_k": i32(3, 3, 3)},
     "seqlen_k"),
    ("padded_q-overlap", i32(0, 5, 10), i32(0, 6, 12),
     {"seqstart_padded_q": i32(0, 3, 10)}, "seqstart_padded_q"),
    ("padded_q-past-tensor", i32(0, 5, 10), i32(0, 6, 12),
     {"seqstart_padded_q": i32(0, 6, 11)}, "seqstart_padded_q"),
    ("padded_k-overlap", i32(0, 5, 10), i32(0, 6, 12),
     {"seqstart_padded_k": i32(0, 5, 12)}, "seqstart_padded_k"),
    ("padded_k-past-tensor", i32(0, 5, 10), i32(0, 6, 12),
     {"seqstart_padded_k": i32(0, 7, 13)}, "seqstart_padded_k"),
]


@pytest.mark.parametrize("name,sq,sk,kw,arg", BAD, ids=[c[0] for c in BAD])
def test_bad_input(name, sq, sk, kw, arg):
    q, k, v = _bad_qkv()
    before = fmha_iree.cache_stats()
    with pytest.raises(ValueError, match=arg):
        fmha_iree.fmha_fwd_varlen(q, k, v, sq, sk, return_lse=True, **kw)
    after = fmha_iree.cache_stats()
    assert after["compiles"] == before["compiles"], "validation must precede compiling"
    assert after.get("disk_hits") == before.get("disk_hits"), "validation must precede loading"


def test_process_usable_after_bad_input():
    q, k, v = packed(seed_of("varlen-after-errors"), 11, 9)
    with pytest.raises(ValueError, match="seqstart_q"):
        fmha_iree.fmha_fwd_varlen(q, k, v, i32(0, 7, 4, 11), i32(0, 4, 6, 9))
    check_varlen(q, k, v, i32(0, 4, 7, 11), i32(0, 4, 6, 9), mask="b", what="after errors")
