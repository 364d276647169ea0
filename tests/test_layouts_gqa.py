"""Layouts (bhsd / bshd) and GQA / MQA head mapping (query head h reads kv head h // (Hq//Hk))."""

import pytest
import torch

import fmha_iree
from common import MAIN, check_fwd, len_id
from reference import assert_close, make_qkv, seed_of

# (id, dtype, Hq, Hk, Dq, Dv, layout): 6 kernel keys (f32 g1 d64 bhsd is MAIN, shared).
CONFIGS = [
    ("f32-mha-bshd", torch.float32, 2, 2, 64, 64, "bshd"),
    ("f32-gqa2-bhsd", torch.float32, 4, 2, 64, 64, "bhsd"),
    ("f32-mqa4-bhsd", torch.float32, 4, 1, 64, 64, "bhsd"),
    ("f16-gqa2-bshd-d128", torch.float16, 4, 2, 128, 128, "bshd"),
    ("f16-mqa4-bshd-d128x64", torch.float16, 4, 1, 128, 64, "bshd"),
    ("bf16-gqa2-bshd-d128", torch.bfloat16, 4, 2, 128, 128, "bshd"),
]
MASKS = ["0", "b", "t:9,4"]
LENGTHS = [(7, 77), (130, 70), (300, 300)]


@pytest.mark.parametrize("sq,sk", LENGTHS, ids=[len_id(p) for p in LENGTHS])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("name,dtype,hq,hk,dq,dv,layout", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_layout_and_heads(name, dtype, hq, hk, dq, dv, layout, mask, sq, sk):
    q, k, v = make_qkv(seed_of("lg", name, mask, sq, sk), B=2, Hq=hq, Hk=hk, Sq=sq, Sk=sk, Dq=dq,
                       Dv=dv, dtype=dtype, layout=layout)
    out, lse = check_fwd(q, k, v, mask=mask, layout=layout, what=f"{name} mask={mask}")
    if layout == "bshd":
        assert tuple(out.shape) == (2, sq, hq, dv)
    else:
        assert tuple(out.shape) == (2, hq, sq, dv)
    assert tuple(lse.shape) == (2, hq, sq)  # lse is [B, Hq, Sq] in both layouts


def test_gqa_heads_are_not_mixed_up():
    """Each kv head gets a very different V, so a wrong head mapping cannot pass by accident."""
    q, k, v = make_qkv(seed_of("gqa-map"), B=1, Hq=4, Hk=2, Sq=20, Sk=30, Dq=64)
    v[:, 1] += 10.0  # kv head 1 -> query heads 2, 3 only
    out, _ = check_fwd(q, k, v, mask="b")
    assert (out[:, :2].abs().mean() < 3) and (out[:, 2:].mean() > 7)


def test_bshd_equals_transposed_bhsd():
    q, k, v = make_qkv(seed_of("bshd-vs-bhsd"), B=2, Hq=2, Sq=50, Sk=61, Dq=64)
    out_h, lse_h = (x.clone() for x in fmha_iree.fmha_fwd(q, k, v, mask="b:7,3",
                                                          return_lse=True))
    t = lambda x: x.transpose(1, 2).contiguous()
    out_s, lse_s = fmha_iree.fmha_fwd(t(q), t(k), t(v), mask="b:7,3", return_lse=True,
                                      layout="bshd")
    assert_close(out_s.transpose(1, 2), out_h.double().numpy(), torch.float32)
    assert_close(lse_s, lse_h.double().numpy(), torch.float32, kind="lse")


def test_non_contiguous_torch_inputs():
    """Strided views (bhsd views of bshd storage, a sliced head dim) are accepted."""
    g = torch.Generator().manual_seed(seed_of("noncontig"))
    base_q = torch.randn(2, 30, 2, 64, generator=g)  # b s h d storage
    base_k = torch.randn(2, 45, 2, 64, generator=g)
    base_v = torch.randn(2, 45, 2, 128, generator=g)[..., ::2]  # stride 2 in d
    q, k, v = (x.transpose(1, 2) for x in (base_q, base_k, base_v))
    assert not q.is_contiguous() and not v.is_contiguous()
    check_fwd(q, k, v, mask="t", layout=MAIN["layout"])
