"""Elementwise bias (``bias``, CK's bias tensor): added to each score after the scale and the
soft-cap, before the mask, on a bias module (``fwd_tiles`` with the bias planes as an argument, the
GPU formulation, built for llvm-cpu here). Checked against the float64 reference
(``reference.attention_ref(bias=)``, numpy broadcasting of the caller's tensor) in every mode (batch
with and without ``cu_seqlen`` padding, group mode with padded starts, paged caches, decode), Sq !=
Sk both ways, every mask kind, GQA (the planes' rows are positions x the group's heads), each dim
shared (size 1), f32 / f16 / bf16, numpy and torch, both layouts; a sequence's result is the same
alone and in a batch and between calls; refusals name ``bias``."""

import numpy as np
import pytest
import torch

import fmha_iree
from reference import assert_close, attention_ref, make_qkv, seed_of, varlen_ref
from test_variants import CAP, _group_inputs, _paged_inputs, check_group_invariance, variant_module


def _bias(shape, seed, dtype=torch.float32, gain=2.0):
    g = torch.Generator().manual_seed(seed_of("bias", tuple(shape), seed))
    return (torch.randn(*shape, generator=g) * gain).to(dtype)


BATCH = [  # (B, Hq, Hk, Sq, Sk, mask, layout, dtype, cu_q, cu_k, bias shape (None: [B, Hq, Sq, Sk]))
    (2, 4, 4, 77, 130, "b", "bshd", torch.float16, None, None, None),
    (2, 4, 2, 130, 77, "t", "bhsd", torch.float32, None, None, None),  # GQA, Sq > Sk
    (3, 4, 1, 150, 150, "b:40,0", "bshd", torch.bfloat16, None, None, (1, 4, 150, 150)),  # MQA, one batch plane
    (2, 2, 2, 90, 200, "t:30,9", "bhsd", torch.float16, [90, 17], [200, 60], (2, 1, 90, 200)),  # heads shared
    (3, 4, 2, 1, 300, "0", "bshd", torch.float16, None, [300, 5, 129], (3, 4, 1, 300)),  # decode, no mask
    (2, 4, 4, 70, 260, "0", "bhsd", torch.float32, None, None, (2, 1, 1, 260)),  # a per-key bias, no mask
    (2, 2, 2, 40, 70, "xb:20", "bshd", torch.float32, None, None, (1, 1, 40, 1)),  # a per-row bias
]


@pytest.mark.parametrize("case", range(len(BATCH)))
def test_bias_batch(case):
    b, hq, hk, sq, sk, mask, layout, dtype, cu_q, cu_k, shape = BATCH[case]
    q, k, v = make_qkv(seed_of("bias", case), B=b, Hq=hq, Hk=hk, Sq=sq, Sk=sk, Dq=64, dtype=dtype, layout=layout)
    bias = _bias(shape or (b, hq, sq, sk), case, dtype)  # the inputs' dtype, as the kernels read it
    kw = dict(mask=mask, layout=layout, cu_seqlen_q=None if cu_q is None else np.cumsum([0] + cu_q),
              cu_seqlen_k=None if cu_k is None else np.cumsum([0] + cu_k))
    r = fmha_iree.route(q, k, v, return_lse=True, bias=bias, **kw)
    assert r.entry in ("fwd_tiles", "fwd_tiles_short"), str(r)
    given = bias.numpy() if case % 2 and dtype != torch.bfloat16 else bias  # numpy and torch biases
    out, lse = fmha_iree.fmha_fwd(q, k, v, return_lse=True, bias=given, **kw)
    ref_out, ref_lse = attention_ref(q, k, v, bias=bias, **{**kw, "mask": None if mask == "0" else mask})
    assert_close(out, ref_out, dtype, what=f"bias batch {case}")
    assert_close(lse, ref_lse, dtype, kind="lse", what=f"bias batch {case}")


def test_bias_group_and_batch_invariance():
    """Group mode (a padded batch's bias, one entry per sequence, wider than the longest), an
    empty sequence and one without keys, padded starts; each sequence's rows are the same alone as
    in the batch, and between repeated calls."""
    lq, lk = [5, 100, 0, 1, 64], [40, 100, 3, 0, 300]
    bias = _bias((len(lq), 4, 110, 310), 1, torch.float16)
    check_group_invariance("bias group", _group_inputs(lq, lk, gain=1.0), lq, lk, dict(bias=bias),
                           lambda b: dict(bias=bias[b:b + 1]))


def test_bias_paged_decode_and_softcap():
    """A paged cache (shuffled pages of 64 rows): decode and a short prefill, GQA 4:2, the bias
    after the soft-cap; sinks on the results."""
    lq, lk = [1, 1, 9], [300, 64, 129]
    q, (k, v, sk), (kc, vc, bt), sq = _paged_inputs(lq, lk)
    bias = _bias((3, 4, 9, 300), 2, torch.float16)
    s = torch.tensor([0.5, -1.0, 2.0, 0.0])
    kw = dict(mask="b", softcap=CAP, return_lse=True)
    out, lse = fmha_iree.fmha_fwd_varlen(q, kc, vc, sq, None, seqlen_k=np.array(lk), block_table=bt, bias=bias,
                                         sinks=s, **kw)
    ref_out, ref_lse = varlen_ref(q, k, v, sq, sk, mask="b", softcap=CAP, bias=bias, sinks=s)
    assert_close(out, ref_out, torch.float16, what="bias paged")
    assert_close(lse, ref_lse, torch.float16, kind="lse", what="bias paged")
    for b in (0, 2):  # a sequence alone gives its rows of the batch, bitwise
        alone, alone_lse = fmha_iree.fmha_fwd_varlen(q[sq[b]:sq[b + 1]], kc, vc, np.array([0, lq[b]]), None,
                                                     seqlen_k=np.array(lk[b:b + 1]), block_table=bt[b:b + 1],
                                                     bias=bias[b:b + 1], sinks=s, **kw)
        assert torch.equal(alone, out[sq[b]:sq[b + 1]]) and torch.equal(alone_lse, lse[:, sq[b]:sq[b + 1]])


def test_bias_device_tensors():
    """DeviceTensor calls take a torch or host bias (uploaded beside them), each call its own, and
    a DeviceTensor bias already in the kernels' layout (read in place); one that is not is refused
    naming what it lacks."""
    q, k, v = make_qkv(seed_of("bias-dev"), B=2, Hq=2, Sq=140, Sk=70, Dq=64, layout="bshd")
    dev = [fmha_iree.to_device(x) for x in (q, k, v)]
    for seed in (3, 4):
        bias = _bias((2, 2, 140, 70), seed)
        ref, _ = attention_ref(q, k, v, mask="t", layout="bshd", bias=bias)
        for given in (bias, fmha_iree.to_device(bias)):
            out = fmha_iree.fmha_fwd(*dev, mask="t", layout="bshd", bias=given).to_numpy()
            assert_close(out, ref, torch.float32, what=f"bias on DeviceTensors {seed}")
    for bad, text in ((_bias((2, 1, 1, 70), 5), "rows and keys not broadcast"),
                      (_bias((2, 2, 140, 70), 5).half(), "dtype f32, not f16")):
        with pytest.raises(TypeError, match=f"bias: a DeviceTensor bias is read as it lies, so it needs {text}"):
            fmha_iree.fmha_fwd(*dev, mask="t", layout="bshd", bias=fmha_iree.to_device(bad))
    with pytest.raises(TypeError, match="bias: a DeviceTensor bias goes with DeviceTensor q, k, v"):
        fmha_iree.fmha_fwd(q, k, v, mask="t", layout="bshd", bias=fmha_iree.to_device(bias))


def test_bias_refusals():
    q, k, v = make_qkv(seed_of("bias-refuse"), B=2, Hq=2, Sq=30, Sk=40, Dq=64, layout="bshd")
    good = _bias((2, 2, 30, 40), 5)
    bad = [(dict(bias=_bias((2, 2, 31, 40), 5)), ValueError, "bias has shape"),
           (dict(bias=_bias((3, 2, 30, 40), 5)), ValueError, "bias has shape"),
           (dict(bias=_bias((2, 30, 40), 5)), ValueError, "bias must be 4-D"),
           (dict(bias="1"), TypeError, "bias must be"),
           (dict(bias=torch.zeros(2, 2, 30, 40, dtype=torch.int32)), TypeError, "bias must hold floats"),
           (dict(bias=good, mask="b:8,0,4"), ValueError, "bias: not with sink tokens"),
           (dict(bias=good, alibi_slopes=np.ones(2, np.float32)), ValueError, "bias and alibi_slopes")]
    for kw, err, text in bad:
        with pytest.raises(err, match=text):
            fmha_iree.fmha_fwd(q, k, v, layout="bshd", **{"mask": "b", **kw})
    with pytest.raises(ValueError, match="bias has shape"):  # group mode: rows short of the longest sequence
        fmha_iree.fmha_fwd_varlen(q[0], k[0], v[0], np.array([0, 30]), np.array([0, 40]), bias=_bias((1, 2, 29, 40), 6))


def test_bias_deployed(tmp_path):
    """``fmha-iree compile --bias`` modules: the manifest says so, calls need the bias, a plain
    module refuses it, both naming ``bias``; decode runs on the short tiles."""
    from fmha_iree.cli import main

    mod = variant_module(tmp_path / "bias.vmfb", "--bias", "4:2")
    q, k, v = make_qkv(seed_of("bias-deploy"), B=2, Hq=4, Hk=2, Sq=33, Sk=90, Dq=64, dtype=torch.float16,
                       layout="bshd")
    bias = _bias((2, 4, 33, 90), 7, torch.float16)
    out = mod(q, k, v, bias=bias)
    ref, _ = attention_ref(q, k, v, mask="b", layout="bshd", bias=bias)
    assert_close(out, ref, torch.float16, what="bias deployed")
    assert mod.route(q[:, :1], k, v, bias=bias[:, :, :1]).entry == "fwd_tiles_short"
    out = mod(q[:, :1], k, v, bias=bias[:, :, :1])  # decode
    ref, _ = attention_ref(q[:, :1], k, v, mask="b", layout="bshd", bias=bias[:, :, :1])
    assert_close(out, ref, torch.float16, what="bias deployed decode")
    with pytest.raises(ValueError, match="bias: module .* was built with a bias"):
        mod(q, k, v)
    plain = tmp_path / "plain.vmfb"
    assert main(["compile", "--target", "host", "--dtype", "f16", "--layout", "bshd", "--hdim", "64", "--heads", "4:2",
                 "-o", str(plain)]) == 0
    with pytest.raises(ValueError, match="bias: module .* was built without a bias"):
        fmha_iree.load(plain)(q, k, v, bias=bias)
    assert main(["compile", "--target", "host", "--dtype", "f16", "--layout", "bshd", "--hdim", "64",
                 "--heads", "2:2", "--bias", "--alibi", "-o", str(tmp_path / "both.vmfb")]) == 2


def test_bias_decode_alone_and_beside_a_prefill():
    """A decode sequence (one query row) gives the same rows alone (the short tiles) as beside a
    40-row prefill chunk (whose batch takes the long tiles)."""
    lq, lk = [1, 40], [300, 200]
    q, k, v, sq, sk = _group_inputs(lq, lk, gain=1.0)
    bias = _bias((2, 4, 40, 300), 8, torch.float16)
    out, lse = fmha_iree.fmha_fwd_varlen(q, k, v, sq, sk, mask="b", bias=bias, return_lse=True)
    ref_out, _ = varlen_ref(q, k, v, sq, sk, mask="b", bias=bias)
    assert_close(out, ref_out, torch.float16, what="bias decode beside a prefill")
    alone, alone_lse = fmha_iree.fmha_fwd_varlen(q[:1], k[:300], v[:300], np.array([0, 1]), np.array([0, 300]),
                                                 mask="b", bias=bias[:1], return_lse=True)
    assert torch.equal(alone, out[:1]) and torch.equal(alone_lse, lse[:, :1])


@pytest.mark.parametrize("target, flag", [("gfx942", "--bias"), ("gfx1100", "--bias"), ("gfx942", "--alibi")])
def test_variant_modules_compile_without_spills(tmp_path, target, flag):
    """The bias and ALiBi modules' gfx code (compiled here, run nowhere): every kernel without
    spills, the attention ops on MFMA / WMMA (docs/BENCHMARKS.md, "Elementwise bias", "ALiBi")."""
    import json

    from fmha_iree.cli import main

    out = tmp_path / "m.vmfb"
    assert main(["compile", "--target", target, "--dtype", "f16", "--hdim", "128", "--heads", "16:16", "--layout",
                 "bshd", "--mask", "b", flag, "-o", str(out)]) == 0
    isa = json.loads(out.with_suffix(".json").read_text())["isa"]
    assert isa and all(k["vgpr_spill_count"] == 0 and k["sgpr_spill_count"] == 0 for k in isa), isa
    assert sum(k["mfma_count"] + k["wmma_count"] for k in isa) > 0
