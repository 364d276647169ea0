"""cu_seqlen_q / cu_seqlen_k (batch mode with padding): effective lengths per batch, the mask uses
the effective lengths, padded query rows are 0 / -inf, padding is never read.

Kernel keys: MAIN, plus f32-g1-bshd and f32-g2-bhsd (shared with test_layouts_gqa.py).
"""

import numpy as np
import pytest
import torch

import fmha_iree
from common import MAIN, check_fwd, cu
from reference import assert_close, make_qkv, seed_of


# (id, Sq padded, Sk padded, q lengths or None, k lengths or None)
CASES = [
    ("both", 40, 50, [5, 40, 1], [50, 3, 17]),
    ("q-only", 40, 50, [40, 7, 1], None),
    ("k-only", 40, 50, None, [1, 50, 13]),
    ("q-shorter-than-k", 9, 300, [9, 2, 5], [257, 300, 130]),
    ("q-longer-than-k", 300, 20, [300, 131, 129], [7, 20, 1]),
    ("tile-edges", 300, 300, [128, 129, 257], [256, 1, 300]),
]
MASKS = ["0", "t", "b", "b:2,1", "t:-1,3", "xb:5"]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("name,sq,sk,lq,lk", CASES, ids=[c[0] for c in CASES])
def test_cu_seqlen(name, sq, sk, lq, lk, mask):
    q, k, v = make_qkv(seed_of("pad", name, mask), B=3, Hq=2, Sq=sq, Sk=sk, Dq=MAIN["Dq"])
    cq = cu(lq) if lq is not None else None
    ck = cu(lk) if lk is not None else None
    out, lse = check_fwd(q, k, v, mask=mask, cu_seqlen_q=cq, cu_seqlen_k=ck,
                         what=f"{name} mask={mask}")
    if lq is not None:
        for b, n in enumerate(lq):
            assert (out[b, :, n:] == 0).all(), f"batch {b}: padded rows must be 0"
            assert torch.isneginf(lse[b, :, n:]).all(), f"batch {b}: padded lse must be -inf"


GARBAGE = [("q", "nan"), ("k", "nan"), ("v", "nan"), ("k", "inf"), ("v", "inf"), ("k", "huge"),
           ("v", "huge")]


@pytest.mark.parametrize("tensor,fill", GARBAGE, ids=[f"{t}-{f}" for t, f in GARBAGE])
def test_padding_is_never_read(tensor, fill):
    """Garbage (NaN / inf / 1e30) in the padding of q, k or v must not reach the result."""
    sq, sk, lq, lk = 70, 90, [70, 33], [41, 90]
    q, k, v = make_qkv(seed_of("pad-garbage", tensor, fill), B=2, Hq=2, Sq=sq, Sk=sk,
                       Dq=MAIN["Dq"])
    val = {"nan": float("nan"), "inf": float("inf"), "huge": 1e30}[fill]
    if tensor == "q":
        q[1, :, lq[1]:] = val
    else:
        {"k": k, "v": v}[tensor][0, :, lk[0]:] = val
    out, lse = check_fwd(q, k, v, mask="b", cu_seqlen_q=cu(lq), cu_seqlen_k=cu(lk),
                         what=f"{tensor} padding={fill}")
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()


@pytest.mark.parametrize("layout,hq,hk", [("bshd", 2, 2), ("bhsd", 4, 2)],
                         ids=["bshd-mha", "bhsd-gqa2"])
def test_cu_seqlen_layouts_gqa(layout, hq, hk):
    q, k, v = make_qkv(seed_of("pad-layout", layout, hq), B=2, Hq=hq, Hk=hk, Sq=60, Sk=140,
                       Dq=MAIN["Dq"], layout=layout)
    check_fwd(q, k, v, mask="b:10,0", layout=layout, cu_seqlen_q=cu([60, 17]),
              cu_seqlen_k=cu([3, 140]), what=layout)


def test_cu_seqlen_full_lengths_equal_no_padding():
    q, k, v = make_qkv(seed_of("pad-full"), B=2, Hq=2, Sq=30, Sk=45, Dq=MAIN["Dq"])
    out, lse = (x.clone() for x in fmha_iree.fmha_fwd(
        q, k, v, mask="b", return_lse=True, cu_seqlen_q=cu([30, 30]), cu_seqlen_k=cu([45, 45])))
    out0, lse0 = fmha_iree.fmha_fwd(q, k, v, mask="b", return_lse=True)
    assert_close(out, out0.double().numpy(), torch.float32)
    assert_close(lse, lse0.double().numpy(), torch.float32, kind="lse")


def test_cu_seqlen_numpy():
    q, k, v = make_qkv(seed_of("pad-numpy"), B=2, Hq=2, Sq=20, Sk=33, Dq=MAIN["Dq"])
    qn, kn, vn = (x.numpy() for x in (q, k, v))
    cq = np.array([0, 20, 31], dtype=np.int32)
    ck = np.array([0, 5, 38], dtype=np.int32)
    out, lse = check_fwd(qn, kn, vn, mask="t", cu_seqlen_q=cq, cu_seqlen_k=ck, what="numpy")
    assert isinstance(out, np.ndarray) and isinstance(lse, np.ndarray)


def test_padded_rows_stay_clear_of_a_nan_row():
    """A NaN query row in the first state slot (batch 0, row 0) poisons its own output and LSE;
    the padded rows of the other batches stay 0 / -inf (finalize reads a padded row's LSE from
    the slot its index was clamped to)."""
    lq = [300, 131, 129]
    q, k, v = make_qkv(seed_of("pad-nan-slot"), B=3, Hq=2, Sq=300, Sk=300, Dq=MAIN["Dq"])
    q[0, 0, 0, 5] = float("nan")
    out, lse = fmha_iree.fmha_fwd(q, k, v, mask="b", cu_seqlen_q=cu(lq), return_lse=True)
    assert torch.isnan(lse[0, 0, 0]) and torch.isnan(out[0, 0, 0]).all()
    for b, n in enumerate(lq[1:], start=1):
        assert (out[b, :, n:] == 0).all(), f"batch {b}: padded rows must be 0"
        assert torch.isneginf(lse[b, :, n:]).all(), f"batch {b}: padded lse must be -inf"
