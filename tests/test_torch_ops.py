"""The torch-native entry points (``fmha_iree.torch_ops``): the custom op eager, under
``torch.compile(fullgraph=True)`` and under ``torch.export``, and the SDPA drop-in against torch's
own SDPA computed in float64, for every mask form it takes; masks it cannot take are refused.

Kernel keys: f32 d64 bhsd, g1 (the workhorse) and g2 (GQA), both compiled by other tests.
"""

from __future__ import annotations

import pytest
import torch

import fmha_iree.torch_ops as ops
from reference import assert_close, attention_ref, make_qkv, seed_of


class Block(torch.nn.Module):
    """A projection, attention through the op, a projection: what a model around it looks like."""

    def __init__(self, d=64):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w_in = torch.nn.Parameter(torch.randn(d, d, generator=g) / d ** 0.5, requires_grad=False)
        self.w_out = torch.nn.Parameter(torch.randn(d, d, generator=g) / d ** 0.5, requires_grad=False)

    def forward(self, x):  # x [B, H, S, D]
        h = x @ self.w_in
        return ops.sdpa(h, h, h, is_causal=True) @ self.w_out


def _x(seed, S=37):
    return make_qkv(seed_of("torch-ops", seed), B=2, Hq=2, Sq=S, Dq=64)[0]


def test_custom_op_eager_matches_reference():
    q, k, v = make_qkv(seed_of("op-eager"), B=2, Hq=2, Sq=21, Sk=40, Dq=64)
    out, lse = torch.ops.fmha_iree.fmha_fwd(q, k, v, "b:7,0", None, "bhsd")
    ref_out, ref_lse = attention_ref(q, k, v, mask="b:7,0")
    assert_close(out, ref_out, torch.float32, what="op out")
    assert_close(lse, ref_lse, torch.float32, kind="lse", what="op lse")


def test_torch_compile_fullgraph_matches_eager():
    model, x = Block(), _x("compile")
    with torch.no_grad():
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_torch_export_records_the_op():
    model, x = Block(), _x("export", S=24)
    with torch.no_grad():
        ep = torch.export.export(model, (x,))
        got = ep.module()(x)
        want = model(x)
    assert "fmha_iree.fmha_fwd" in str(ep.graph)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _torch_sdpa64(q, k, v, **kw):
    g = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(g, 1) for x in (k, v))
    return torch.nn.functional.scaled_dot_product_attention(q.double(), k, v, **kw)


def _window(sq, sk, left, right):
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    m = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        m &= j >= i - left
    if right >= 0:
        m &= j <= i + right
    return m


SDPA_CASES = [  # (id, Hq, Hk, Sq, Sk, kwargs)
    ("plain", 2, 2, 30, 30, {}),
    ("causal", 2, 2, 30, 30, dict(is_causal=True)),
    ("causal-sq<sk", 2, 2, 13, 50, dict(is_causal=True)),  # torch's is_causal is top-left
    ("window-mask", 2, 2, 40, 40, dict(attn_mask=_window(40, 40, 5, 0))),
    ("band-mask-4d", 2, 2, 33, 45, dict(attn_mask=_window(33, 45, 3, 9)[None, None])),
    ("scale", 2, 2, 20, 20, dict(scale=0.05)),
    ("gqa", 4, 2, 25, 25, dict(enable_gqa=True, is_causal=True)),
]


@pytest.mark.parametrize("name,hq,hk,sq,sk,kw", SDPA_CASES, ids=[c[0] for c in SDPA_CASES])
def test_sdpa_matches_torch(name, hq, hk, sq, sk, kw):
    q, k, v = make_qkv(seed_of("sdpa", name), B=2, Hq=hq, Hk=hk, Sq=sq, Sk=sk, Dq=64)
    got = ops.sdpa(q, k, v, **kw)
    want = _torch_sdpa64(q, k, v, **{n: x for n, x in kw.items() if n != "enable_gqa"})
    assert got.dtype == q.dtype and got.shape == q.shape
    assert_close(got, want.numpy(), torch.float32, what=f"sdpa {name}")


def test_sdpa_refuses_what_it_cannot_take():
    q, k, v = make_qkv(seed_of("sdpa-bad"), B=1, Hq=4, Hk=2, Sq=16, Sk=16, Dq=64)
    g = torch.Generator().manual_seed(1)
    with pytest.raises(ValueError, match="enable_gqa"):
        ops.sdpa(q, k, v)
    qq, kk, vv = q[:, :2], k, v
    for bad in (torch.rand(16, 16, generator=g) > 0.5, torch.zeros(16, 16), torch.ones(2, 16, 16, dtype=torch.bool),
                _window(16, 16, 2, 0).logical_not()):
        with pytest.raises(ValueError, match="attn_mask"):
            ops.sdpa(qq, kk, vv, attn_mask=bad)
    with pytest.raises(ValueError, match="is_causal"):
        ops.sdpa(qq, kk, vv, attn_mask=_window(16, 16, 2, 0), is_causal=True)
