"""The torch-native entry points (``fmha_iree.integrations.torch_ops``): the batch-mode and group-mode custom
ops eager (against the float64 reference), under ``torch.compile(fullgraph=True)`` and under
``torch.export``, and the SDPA drop-in against torch's own SDPA computed in float64, for every mask
form it takes; masks it cannot take are refused.

Kernel keys: f32 d64 bhsd, g1 (the workhorse) and g2 (GQA); group mode f32 d64 bshd g2 (the
workhorse of test_varlen.py); all compiled by other tests too.
"""

from __future__ import annotations

import pytest
import torch

import fmha_iree
import fmha_iree.integrations.torch_ops as ops
from reference import assert_close, attention_ref, make_qkv, seed_of, varlen_ref


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


def _window(sq, sk, left, right, shift=0):
    """Row i sees keys i + shift - left <= j <= i + shift + right (a negative side: unlimited)."""
    i, j = torch.arange(sq)[:, None] + shift, torch.arange(sk)[None, :]
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
    ("kv-prefix-causal", 2, 2, 9, 30, dict(attn_mask=_window(9, 30, -1, 0, shift=21))),  # bottom-right
    ("kv-prefix-window", 2, 2, 3, 40, dict(attn_mask=_window(3, 40, 5, 0, shift=37)[None])),
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



def test_attention_with_bias_and_alibi_eager_and_compiled():
    """``attention(bias=)`` and ``attention(alibi_slopes=)``: eager and under
    ``torch.compile(fullgraph=True)`` (the op takes them as tensors), against float64."""
    q, k, v = make_qkv(seed_of("ops-bias"), B=2, Hq=2, Sq=24, Sk=40, Dq=64)
    bias = torch.randn(2, 1, 24, 40, generator=torch.Generator().manual_seed(4))
    slopes = torch.tensor([0.25, 0.0625])
    for kw in (dict(bias=bias), dict(alibi_slopes=slopes)):
        want, _ = attention_ref(q, k, v, mask="b", **kw)
        got = ops.attention(q, k, v, mask="b", **kw)
        assert_close(got, want, torch.float32, what=f"attention {list(kw)}")
        fn = torch.compile(lambda a, b, c, x, kw=kw: ops.attention(a, b, c, mask="b", **{next(iter(kw)): x}),
                           fullgraph=True, backend="aot_eager")
        assert torch.equal(fn(q, k, v, next(iter(kw.values()))), got)


def test_sdpa_is_a_public_name():
    """The drop-in is ``fmha_iree.sdpa`` (the issue's name), the same function as the op module's."""
    assert fmha_iree.sdpa is ops.sdpa and "sdpa" in fmha_iree.__all__

def test_sdpa_takes_any_mask_as_a_bias():
    """Masks that are no CK window (random, per batch entry, a window's complement) and float masks
    run as an elementwise bias: torch's SDPA result on every row that sees a key, 0 on the others;
    refusals name enable_gqa and is_causal."""
    q, k, v = make_qkv(seed_of("sdpa-bias"), B=2, Hq=4, Hk=2, Sq=16, Sk=20, Dq=64)
    g = torch.Generator().manual_seed(1)
    with pytest.raises(ValueError, match="enable_gqa"):
        ops.sdpa(q, k, v)
    with pytest.raises(ValueError, match="is_causal"):
        ops.sdpa(q[:, :2], k, v, attn_mask=_window(16, 20, 2, 0), is_causal=True)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    for mask in (torch.rand(16, 20, generator=g) > 0.5, torch.randn(16, 20, generator=g),
                 torch.rand(2, 1, 16, 20, generator=g) > 0.3, _window(16, 20, 2, 0).logical_not(),
                 torch.randn(2, 4, 16, 20, generator=g)):
        got = ops.sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
        want = torch.nn.functional.scaled_dot_product_attention(q.double(), kk.double(), vv.double(),
                                                                attn_mask=mask if mask.dtype == torch.bool else
                                                                mask.double())
        sees = torch.ones(2, 4, 16, 20, dtype=torch.bool) & (mask if mask.dtype == torch.bool else True)
        sees = sees.any(-1)
        assert_close(got[sees], want[sees].numpy(), torch.float32, what="sdpa, a mask as a bias")
        assert not got[~sees].any()


# --------------------------------------------------------------------------------------------
# Group mode: torch.ops.fmha_iree.fmha_fwd_varlen (f32 d64 bshd, Hq 2 / Hk 1)
# --------------------------------------------------------------------------------------------
def _starts(lengths, gaps=None):
    """int32 [B+1] starts; with ``gaps``, gaps[b] free rows precede sequence b."""
    s, pos = [], 0
    for n, gap in zip(lengths, gaps or [0] * len(lengths)):
        s.append(pos + gap)
        pos += gap + n
    return torch.tensor(s + [pos], dtype=torch.int32)


def _packed(seed, tq, tk, dv=64):
    q, k, v = make_qkv(seed, B=1, Hq=2, Hk=1, Sq=tq, Sk=tk, Dq=64, Dv=dv, layout="bshd")
    return q[0].contiguous(), k[0].contiguous(), v[0].contiguous()


def _check_varlen(got, want, what):
    (out, lse), (ref_out, ref_lse) = got, want
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert_close(out, ref_out, torch.float32, what=f"{what} out")
    assert_close(lse, ref_lse, torch.float32, kind="lse", what=f"{what} lse")


VARLEN_CASES = [  # (id, query lengths, key lengths, mask, extra)
    ("causal", [5, 17, 1, 40], [9, 17, 30, 41], "b", {}),
    ("window", [12, 3, 25], [12, 20, 25], "t:3,2", {}),
    ("seqlen_k", [6, 11], [20, 15], "b", {"seqlen_k": [14, 15]}),
]


@pytest.mark.parametrize("name,lq,lk,mask,extra", VARLEN_CASES, ids=[c[0] for c in VARLEN_CASES])
def test_varlen_op_matches_reference(name, lq, lk, mask, extra):
    q, k, v = _packed(seed_of("op-varlen", name), sum(lq), sum(lk))
    sq, sk = _starts(lq), _starts(lk)
    kw = {n: torch.tensor(x, dtype=torch.int32) for n, x in extra.items()}
    want = varlen_ref(q, k, v, sq, sk, mask=mask, **kw)
    op = torch.ops.fmha_iree.fmha_fwd_varlen(q, k, v, sq, sk, kw.get("seqlen_k"), mask=mask)
    _check_varlen(op, want, f"op {name}")
    _check_varlen(ops.fmha_fwd_varlen(q, k, v, sq, sk, mask=mask, return_lse=True, **kw), want, f"wrapper {name}")
    direct = fmha_iree.fmha_fwd_varlen(q, k, v, sq, sk, mask=mask, return_lse=True, **kw)
    assert all(torch.equal(a, b) for a, b in zip(op, direct)), "the op must be fmha_fwd_varlen itself"


def test_varlen_op_padded_starts_give_lse_of_the_unpadded_total():
    """Sequences stored with gaps: out keeps the physical rows (Tq), lse has seqstart_q[-1] < Tq columns."""
    lq, lk = [7, 20, 4], [7, 33, 10]
    pq, pk = _starts(lq, gaps=[3, 5, 2]), _starts(lk, gaps=[0, 4, 1])
    q, k, v = _packed(seed_of("op-varlen-padded"), int(pq[-1]) + 6, int(pk[-1]) + 2, dv=64)
    sq, sk = _starts(lq), _starts(lk)
    got = ops.fmha_fwd_varlen(q, k, v, sq, sk, seqstart_padded_q=pq, seqstart_padded_k=pk, mask="b", return_lse=True)
    assert got[0].shape == (q.shape[0], 2, 64) and got[1].shape == (2, sum(lq))
    _check_varlen(got, varlen_ref(q, k, v, sq, sk, seqstart_padded_q=pq, seqstart_padded_k=pk, mask="b"), "padded")


def test_varlen_op_paged_cache():
    """block_table with seqstart_k None (a Tensor? argument): the reference reads the pages itself."""
    g = torch.Generator().manual_seed(seed_of("op-paged"))
    k_cache, v_cache = torch.randn(5, 16, 1, 64, generator=g), torch.randn(5, 16, 1, 64, generator=g)
    table = torch.tensor([[3, 0, -1], [4, 1, 2]], dtype=torch.int32)
    lk = torch.tensor([20, 40], dtype=torch.int32)
    sq = _starts([3, 9])
    q = torch.randn(12, 2, 64, generator=g)
    pages = [[(int(table[b, j // 16]), j % 16) for j in range(int(lk[b]))] for b in range(2)]
    k, v = (torch.stack([c[p, r] for seq in pages for p, r in seq]) for c in (k_cache, v_cache))
    got = ops.fmha_fwd_varlen(q, k_cache, v_cache, sq, None, seqlen_k=lk, block_table=table, mask="b", return_lse=True)
    _check_varlen(got, varlen_ref(q, k, v, sq, _starts(lk.tolist()), mask="b"), "paged")


class Packed(torch.nn.Module):
    """Projections around group-mode attention over packed tokens x [T, 2, 64] (K/V from head 0: GQA)."""

    def __init__(self, d=64):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.w = torch.nn.Parameter(torch.randn(d, d, generator=g) / d ** 0.5, requires_grad=False)

    def forward(self, x, seqstart_q, seqstart_k):
        h = x @ self.w
        kv = h[:, :1].contiguous()
        out, lse = ops.fmha_fwd_varlen(h, kv, kv, seqstart_q, seqstart_k, mask="b", return_lse=True)
        return out @ self.w, lse.exp().sum()


def _packed_input(seed, lengths=(9, 30, 2)):
    x = make_qkv(seed_of("op-varlen-model", seed), B=1, Hq=2, Sq=sum(lengths), Dq=64, layout="bshd")[0][0]
    return x.contiguous(), _starts(lengths), _starts(lengths)


def test_varlen_op_torch_compile_fullgraph():
    model, args = Packed(), _packed_input("compile")
    with torch.no_grad():
        eager = model(*args)
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(*args)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_varlen_op_torch_export():
    """Exported with the token count and the number of sequences dynamic, the program serves
    another batch composition too."""
    model, args = Packed(), _packed_input("export")
    tokens, starts = torch.export.Dim("tokens", min=2, max=4096), torch.export.Dim("starts", min=2, max=64)
    with torch.no_grad():
        ep = torch.export.export(model, args, dynamic_shapes=({0: tokens}, {0: starts}, {0: starts}))
        assert "fmha_iree.fmha_fwd_varlen" in str(ep.graph)
        for inputs in (args, _packed_input("export-other", lengths=(70, 1, 5, 16))):
            for a, b in zip(ep.module()(*inputs), model(*inputs)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_varlen_opcheck():
    q, k, v = _packed(seed_of("opcheck"), 20, 26)
    sq, sk = _starts([8, 12]), _starts([10, 16])
    args = (q, k, v, sq, sk, None, None, None, None, "b", None)
    torch.library.opcheck(torch.ops.fmha_iree.fmha_fwd_varlen.default, args)


def test_varlen_wrapper_refuses_bad_arguments():
    q, k, v = _packed(seed_of("varlen-bad"), 4, 4)
    sq = _starts([4])
    with pytest.raises(TypeError, match="return_lse"):
        ops.fmha_fwd_varlen(q, k, v, sq, sq, return_lse=1)
    with pytest.raises(TypeError, match="mask"):
        ops.fmha_fwd_varlen(q, k, v, sq, sq, mask=2)
    with pytest.raises(TypeError, match="seqstart_k"):
        ops.fmha_fwd_varlen(q, k, v, sq, [0, 4])
    with pytest.raises(ValueError, match="seqstart_q"):
        ops.fmha_fwd_varlen(q, k, v, torch.tensor([0, 9], dtype=torch.int32), sq)
