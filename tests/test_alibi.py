"""ALiBi (``alibi_slopes``): head ``h`` adds ``-slope[h] * |p - j|`` to its scores, ``p`` the row's
position in the mask's frame (bottom-right aligned without a mask), on an ALiBi module
(``fwd_tiles`` with the slopes as an argument, the GPU formulation, built for llvm-cpu here).
Checked against the float64 reference written from the issue's statement (``reference.alibi_bias``)
in every mode (batch with and without ``cu_seqlen`` padding, group mode with padded starts, paged
caches, decode), Sq != Sk both ways, top-left and bottom-right masks and windows, [Hq] and [B, Hq]
slopes, f32 / f16 / bf16 and both layouts, with the soft-cap and the sinks; a sequence's result
is the same alone and in a batch; refusals name ``alibi_slopes``."""

import numpy as np
import pytest
import torch

import fmha_iree
from fmha_iree.problem.mask import Mask
from reference import assert_close, attention_ref, make_qkv, seed_of, varlen_ref
from test_variants import CAP, _cu, _group_inputs, _paged_inputs, check_group_invariance, variant_module


def _slopes(h: int, rows: int = 0, seed: int = 0) -> np.ndarray:
    """BLOOM's slopes ``2 ** (-8 (i + 1) / h)`` ([h]), or random ones per row ([rows, h])."""
    if not rows:
        return (2.0 ** (-8.0 * np.arange(1, h + 1) / h)).astype(np.float32)
    return np.random.default_rng(seed).uniform(0.01, 0.5, (rows, h)).astype(np.float32)


BATCH = [  # (B, Sq, Sk, mask, layout, dtype, cu_q, cu_k, per-batch slopes)
    (2, 77, 130, "b", "bshd", torch.float16, None, None, False),
    (2, 130, 77, "t", "bhsd", torch.float32, None, None, True),  # Sq > Sk: rows past the keys
    (3, 150, 150, "b:40,0", "bshd", torch.bfloat16, None, None, False),
    (2, 90, 200, "t:30,0", "bhsd", torch.float16, [90, 17], [200, 60], True),
    (3, 1, 300, "0", "bshd", torch.float16, None, [300, 5, 129], False),  # decode, no mask
    (2, 3, 257, "b", "bshd", torch.float32, None, None, True),  # a few rows over many keys
]


@pytest.mark.parametrize("case", range(len(BATCH)))
def test_alibi_batch(case):
    b, sq, sk, mask, layout, dtype, cu_q, cu_k, per_batch = BATCH[case]
    q, k, v = make_qkv(seed_of("alibi", case), B=b, Hq=4, Sq=sq, Sk=sk, Dq=64, dtype=dtype, layout=layout)
    sl = _slopes(4, b if per_batch else 0, case)
    cq, ck = (None if x is None else _cu(x) for x in (cu_q, cu_k))
    kw = dict(mask=mask, layout=layout, cu_seqlen_q=cq, cu_seqlen_k=ck)
    r = fmha_iree.route(q, k, v, return_lse=True, alibi_slopes=sl, **kw)
    assert (r.path, r.entry) == ("tiles", "fwd_tiles_short" if sq <= 16 else "fwd_tiles")  # decode: 16-row tiles
    out, lse = fmha_iree.fmha_fwd(q, k, v, return_lse=True, alibi_slopes=torch.from_numpy(sl), **kw)
    ref_out, ref_lse = attention_ref(q, k, v, alibi_slopes=sl, **{**kw, "mask": None if mask == "0" else mask})
    plain, _ = attention_ref(q, k, v, **{**kw, "mask": None if mask == "0" else mask})
    assert np.abs(ref_out - plain).max() > 0.05  # the bias changes these results
    assert_close(out, ref_out, dtype, what=f"alibi batch {case}")
    assert_close(lse, ref_lse, dtype, kind="lse", what=f"alibi batch {case}")


def test_alibi_group_and_batch_invariance():
    """Group mode, per-sequence slopes, an empty sequence and one without keys, padded starts; each
    sequence's rows are the same alone as in the batch, and between repeated calls."""
    lq, lk = [5, 100, 0, 1, 64], [40, 100, 3, 0, 300]
    q, k, v, sq, sk = _group_inputs(lq, lk, gain=1.0)
    k, v = k[:, :1].expand(-1, 4, -1).contiguous(), v[:, :1].expand(-1, 4, -1).contiguous()  # Hq == Hk
    sl = _slopes(4, len(lq), 7)
    check_group_invariance("alibi group", (q, k, v, sq, sk), lq, lk, dict(alibi_slopes=sl),
                           lambda b: dict(alibi_slopes=sl[b]))


def test_alibi_paged_decode():
    """A paged cache (shuffled pages of 64 rows): decode and a short prefill, [Hq] slopes."""
    lq, lk = [1, 1, 9], [300, 64, 129]
    q, (k, v, sk), (kc, vc, bt), sq = _paged_inputs(lq, lk)
    # Hq == Hk: the cache's two KV heads, q's first two heads
    q = q[:, :2].contiguous()
    sl = _slopes(2)
    out, lse = fmha_iree.fmha_fwd_varlen(q, kc, vc, sq, None, seqlen_k=np.array(lk), block_table=bt, mask="b",
                                         alibi_slopes=sl, return_lse=True)
    ref_out, ref_lse = varlen_ref(q, k, v, sq, sk, mask="b", alibi_slopes=sl)
    assert_close(out, ref_out, torch.float16, what="alibi paged")
    assert_close(lse, ref_lse, torch.float16, kind="lse", what="alibi paged")


def test_alibi_with_softcap_and_sinks():
    """ALiBi after the soft-cap, sinks on the results; a DeviceTensor call gives the same."""
    q, k, v = make_qkv(seed_of("alibi-all"), B=2, Hq=2, Sq=70, Sk=70, Dq=64, dtype=torch.float32, layout="bshd")
    q = q * 4
    sl, s = _slopes(2), np.array([1.5, -0.5], np.float32)
    kw = dict(mask="t", layout="bshd", softcap=CAP, alibi_slopes=sl)
    out, lse = fmha_iree.fmha_fwd(q, k, v, return_lse=True, sinks=s, **kw)
    ref_out, ref_lse = attention_ref(q, k, v, mask="t", layout="bshd", softcap=CAP, sinks=s, alibi_slopes=sl)
    assert_close(out, ref_out, torch.float32, what="alibi + cap + sinks")
    assert_close(lse, ref_lse, torch.float32, kind="lse", what="alibi + cap + sinks")
    dev = [fmha_iree.to_device(x) for x in (q, k, v)]
    plain = fmha_iree.fmha_fwd(q, k, v, **kw)
    for _ in range(2):  # the second call replays the first (prepared.PreparedCalls)
        np.testing.assert_array_equal(fmha_iree.fmha_fwd(*dev, **kw).to_numpy(), plain.numpy())
    other = sl * 3  # other slopes: another prepared call, not the first's replay
    ref_other, _ = attention_ref(q, k, v, mask="t", layout="bshd", softcap=CAP, alibi_slopes=other)
    assert_close(fmha_iree.fmha_fwd(*dev, **{**kw, "alibi_slopes": other}).to_numpy(), ref_other, torch.float32,
                 what="alibi, other slopes on DeviceTensors")


def test_alibi_refusals():
    q, k, v = make_qkv(seed_of("alibi-refuse"), B=2, Hq=2, Sq=70, Sk=70, Dq=64, layout="bshd")
    sl = _slopes(2)
    bad = [(dict(alibi_slopes=_slopes(3)), ValueError, "alibi_slopes must have shape"),
           (dict(alibi_slopes=np.zeros((3, 2), np.float32)), ValueError, "alibi_slopes must have shape"),
           (dict(alibi_slopes=np.array([1, np.nan], np.float32)), ValueError, "alibi_slopes must be finite"),
           (dict(alibi_slopes="0.5"), TypeError, "alibi_slopes"),
           (dict(alibi_slopes=np.array([True, False])), TypeError, "alibi_slopes"),
           (dict(alibi_slopes=sl, mask="b:8,0,4"), ValueError, "alibi_slopes: not with sink tokens"),
           (dict(alibi_slopes=sl, mask="0"), ValueError, "alibi_slopes: rows that see keys right"),
           (dict(alibi_slopes=sl, mask=Mask.window(-1, 100)), ValueError, "alibi_slopes: rows that see keys right")]
    for kw, err, text in bad:
        with pytest.raises(err, match=text):
            fmha_iree.fmha_fwd(q, k, v, layout="bshd", **{"mask": "b", **kw})
    qg, kg, vg = make_qkv(seed_of("alibi-gqa"), B=1, Hq=4, Hk=2, Sq=8, Dq=64, layout="bshd")
    with pytest.raises(ValueError, match="alibi_slopes: ALiBi takes one query head per KV head"):
        fmha_iree.fmha_fwd(qg, kg, vg, layout="bshd", alibi_slopes=_slopes(4))
    # a narrow window with a right side: no tile's interior (keys all its rows see) is right of a row
    out = fmha_iree.fmha_fwd(q, k, v, layout="bshd", mask=Mask.window(4, 2), alibi_slopes=sl)
    ref, _ = attention_ref(q, k, v, mask="b:4,2", layout="bshd", alibi_slopes=sl)
    assert_close(out, ref, torch.float32, what="alibi, a window's right side")


def test_alibi_deployed(tmp_path):
    """``fmha-iree compile --alibi`` modules: the manifest says so, calls need the slopes, a plain
    module refuses them, both naming ``alibi_slopes``."""
    from fmha_iree.cli import main

    mod = variant_module(tmp_path / "alibi.vmfb", "--alibi", "2:2")
    q, k, v = make_qkv(seed_of("alibi-deploy"), B=2, Hq=2, Sq=33, Sk=90, Dq=64, dtype=torch.float16, layout="bshd")
    sl = _slopes(2)
    out = mod(q, k, v, alibi_slopes=sl)
    ref, _ = attention_ref(q, k, v, mask="b", layout="bshd", alibi_slopes=sl)
    assert_close(out, ref, torch.float16, what="alibi deployed")
    assert mod.route(q[:, :1], k, v, alibi_slopes=sl).entry == "fwd_tiles_short"
    out = mod(q[:, :1], k, v, alibi_slopes=sl)  # decode
    ref, _ = attention_ref(q[:, :1], k, v, mask="b", layout="bshd", alibi_slopes=sl)
    assert_close(out, ref, torch.float16, what="alibi deployed decode")
    with pytest.raises(ValueError, match="alibi_slopes: module .* was built with ALiBi"):
        mod(q, k, v)
    assert main(["compile", "--target", "host", "--dtype", "f16", "--layout", "bshd", "--hdim", "64",
                 "--heads", "4:2", "--alibi", "-o", str(tmp_path / "gqa.vmfb")]) == 2
