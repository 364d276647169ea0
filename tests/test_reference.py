"""Sanity tests of the float64 reference itself (no fmha_iree involved)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from reference import (assert_close, attention_ref, make_qkv, parse_mask, visible,
                       visible_ck_coords)

def _m(rows):
    return np.array([[c == "1" for c in r] for r in rows], dtype=bool)


# Hand-written visible matrices (rows = query i, columns = key j).
HAND = [
    # causal bottom-right, Sq < Sk: j <= i + 2
    ("b", 3, 5, ["11100", "11110", "11111"]),
    ("2", 3, 5, ["11100", "11110", "11111"]),
    # causal top-left, Sq < Sk: j <= i
    ("t", 3, 5, ["10000", "11000", "11100"]),
    ("1", 3, 5, ["10000", "11000", "11100"]),
    # causal bottom-right, Sq > Sk: j <= i - 2, rows 0 and 1 see nothing
    ("b", 5, 3, ["000", "000", "100", "110", "111"]),
    # causal top-left, Sq > Sk
    ("t", 5, 3, ["100", "110", "111", "111", "111"]),
    # top-left window l=1, r=1 (band)
    ("t:1,1", 4, 4, ["1100", "1110", "0111", "0011"]),
    # bottom-right window l=0, r=1 with Sk - Sq = 2: 2+i <= j <= 3+i
    ("b:0,1", 2, 4, ["0011", "0001"]),
    # unlimited left, r = 0 == causal
    ("t:-1,0", 3, 3, ["100", "110", "111"]),
    # l = 0, unlimited right (anti-causal)
    ("t:0,-1", 3, 4, ["1111", "0111", "0011"]),
    ("b:-1,-1", 3, 5, ["11111"] * 3),
    # xformers: w = 3 -> l = 1, r = 1
    ("xt:3", 4, 4, ["1100", "1110", "0111", "0011"]),
    # xformers: w = 4 -> l = 2, r = 1, bottom-right shift 1
    ("xb:4", 2, 3, ["111", "111"]),
    ("xb:2", 3, 4, ["1100", "0110", "0011"]),
    # xformers negative window: causal
    ("xb:-1", 3, 5, ["11100", "11110", "11111"]),
    ("0", 2, 3, ["111", "111"]),
]


@pytest.mark.parametrize("mask,sq,sk,rows", HAND, ids=[f"{m}-{a}x{b}" for m, a, b, _ in HAND])
def test_visible_hand_written(mask, sq, sk, rows):
    np.testing.assert_array_equal(visible(mask, sq, sk), _m(rows))


MASKS = ["0", "t", "b", "1", "2", "t:3,5", "b:3,5", "t:-1,2", "b:4,-1", "t:-1,-1", "b:0,0",
         "xt:-1", "xb:-3", "xt:5", "xb:8", "t:0,-1", "b:-1,0"]
LENGTHS = [(1, 1), (1, 9), (9, 1), (5, 12), (12, 5), (10, 10)]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("sq,sk", LENGTHS, ids=[f"{a}x{b}" for a, b in LENGTHS])
def test_visible_matches_ck_coordinates(mask, sq, sk):
    """The direct window rule and the doc's (y, x) coordinate formulation agree."""
    np.testing.assert_array_equal(visible(mask, sq, sk), visible_ck_coords(mask, sq, sk))


def test_parse_mask_forms():
    assert parse_mask("0") is None and parse_mask(None) is None
    assert parse_mask("t") == parse_mask("1") == parse_mask("t:-1,0") == (-1, 0, True)
    assert parse_mask("b") == parse_mask("2") == (-1, 0, False)
    assert parse_mask("xt:-1") == (-1, 0, True)
    assert parse_mask("xt:7") == (3, 3, True)
    assert parse_mask("xb:6") == (3, 2, False)
    for bad in ("", "x", "t:", "t:1", "b:a,b", "xt:", "3"):
        with pytest.raises(ValueError):
            parse_mask(bad)


def _sdpa(q, k, v, **kw):
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kw).numpy()


@pytest.mark.parametrize("sq,sk", [(5, 5), (7, 13), (13, 7)], ids=str)
def test_unmasked_matches_sdpa(sq, sk):
    q, k, v = make_qkv(11 + sq, B=2, Hq=3, Sq=sq, Sk=sk, Dq=16, Dv=24)
    out, lse = attention_ref(q, k, v)
    np.testing.assert_allclose(out, _sdpa(q, k, v), rtol=1e-12, atol=1e-12)
    s = (q.double() @ k.double().transpose(-1, -2)) / np.sqrt(16)
    np.testing.assert_allclose(lse, torch.logsumexp(s, -1).numpy(), rtol=1e-12, atol=1e-12)


def test_causal_matches_sdpa():
    q, k, v = make_qkv(5, B=1, Hq=2, Sq=9, Dq=8)
    for mask in ("t", "b", "1", "2", "xt:-1"):  # identical when Sq == Sk
        out, _ = attention_ref(q, k, v, mask=mask)
        np.testing.assert_allclose(out, _sdpa(q, k, v, is_causal=True), rtol=1e-12, atol=1e-12)


def test_scale_and_gqa_match_sdpa():
    q, k, v = make_qkv(6, B=1, Hq=4, Hk=2, Sq=6, Sk=8, Dq=8)
    out, _ = attention_ref(q, k, v, scale=0.7)
    ref = _sdpa(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), scale=0.7)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)


def test_bshd_layout_is_a_transpose():
    q, k, v = make_qkv(8, B=2, Hq=4, Hk=1, Sq=5, Sk=6, Dq=8, layout="bshd")
    out, lse = attention_ref(q, k, v, mask="b:1,1", layout="bshd")
    t = lambda x: x.transpose(1, 2)
    out2, lse2 = attention_ref(t(q), t(k), t(v), mask="b:1,1")
    np.testing.assert_array_equal(out, out2.transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(lse, lse2)


def test_fully_masked_rows_and_padding():
    q, k, v = make_qkv(9, B=2, Hq=1, Sq=6, Sk=4, Dq=8)
    out, lse = attention_ref(q, k, v, mask="b")  # Sq-Sk = 2 rows see nothing
    assert (out[:, :, :2] == 0).all() and np.isneginf(lse[:, :, :2]).all()
    assert np.isfinite(lse[:, :, 2:]).all()
    cu_q = torch.tensor([0, 3, 9], dtype=torch.int32)  # lengths 3, 6
    cu_k = torch.tensor([0, 4, 5], dtype=torch.int32)  # lengths 4, 1
    out, lse = attention_ref(q, k, v, mask="b", cu_seqlen_q=cu_q, cu_seqlen_k=cu_k)
    assert (out[0, :, 3:] == 0).all() and np.isneginf(lse[0, :, 3:]).all()
    # batch 1: sq=6, sk=1: only row 5 sees key 0 -> out = v[1, 0, 0]
    assert np.isneginf(lse[1, :, :5]).all()
    np.testing.assert_allclose(out[1, 0, 5], v[1, 0, 0].double().numpy(), rtol=0, atol=0)
    # padding is not read: changing it does not change the result
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 1:] = 1e3
    v2[1, :, 1:] = float("nan")
    out2, lse2 = attention_ref(q, k2, v2, mask="b", cu_seqlen_q=cu_q, cu_seqlen_k=cu_k)
    np.testing.assert_array_equal(out, out2)
    np.testing.assert_array_equal(lse, lse2)


def test_assert_close_semantics():
    ref = np.array([1.0, -np.inf, 0.5])
    assert_close(np.array([1.0, -np.inf, 0.5000001]), ref, torch.float32)
    with pytest.raises(AssertionError, match="NaN"):
        assert_close(np.array([np.nan, -np.inf, 0.5]), ref, torch.float32)
    with pytest.raises(AssertionError, match="inf"):
        assert_close(np.array([1.0, 0.0, 0.5]), ref, torch.float32)
    with pytest.raises(AssertionError, match="inf"):
        assert_close(np.array([1.0, -np.inf, -np.inf]), ref, torch.float32)
    with pytest.raises(AssertionError, match="tolerance"):
        assert_close(np.array([1.001, -np.inf, 0.5]), ref, torch.float32)
    assert_close(np.array([1.001, -np.inf, 0.5]), ref, torch.float16)
    with pytest.raises(AssertionError, match="shape"):
        assert_close(np.zeros(2), ref, torch.float32)
    # NaN expected and present is fine (NaN-row isolation tests rely on it)
    assert_close(np.array([np.nan, 1.0]), np.array([np.nan, 1.0]), torch.float32)
