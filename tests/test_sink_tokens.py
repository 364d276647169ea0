"""Sink tokens (StreamingLLM; ``Mask.sink``, the ``t:l,r,s`` / ``b:l,r,s`` strings): the first
``s`` keys of each sequence stay visible beside a sliding window, within each row's right side.
Every path computes the window; ``paths.sink_tokens`` adds the sink keys to its results. Checked
against the float64 reference, whose mask rule is written from the issue's statement
(``reference.visible``), in every mode (batch with and without ``cu_seqlen`` padding, group mode
with padded starts, paged caches, decode), with GQA, Sq != Sk, f32 / f16 / bf16, the soft-cap and
the sinks, on CPU paths and on the GPU formulation's window path; a sequence's result is the same
alone and in a batch."""

import numpy as np
import pytest
import torch

import fmha_iree
from common import gpu_formulation, route, run_batch, run_group
from fmha_iree.paths.sink_tokens import batch_sink_tokens, varlen_sink_tokens
from fmha_iree.problem.mask import Mask
from fmha_iree.problem.spec import check_batch, check_varlen
from reference import assert_close, attention_ref, make_qkv, seed_of, varlen_ref
from test_variants import CAP, _cu, _group_inputs, _paged_inputs

BATCH = [  # (B, Sq, Sk, mask, layout, dtype, cu_q, cu_k, path)
    (2, 30, 300, "b:40,0,4", "bhsd", torch.float32, None, None, "rows"),
    (2, 300, 300, "t:64,0,8", "bhsd", torch.float32, None, None, "cpu_group"),
    (2, 300, 3000, "b:200,0,4", "bhsd", torch.float32, None, None, "units"),
    (2, 40, 20, "b:3,0,2", "bshd", torch.float16, [40, 7], None, "rows"),
    (3, 1, 500, "b:64,0,4", "bshd", torch.bfloat16, None, [500, 3, 70], "rows"),  # decode
    (2, 50, 90, "t:5,3,6", "bhsd", torch.float32, [50, 11], [90, 30], "rows"),  # a right side > 0
]


@pytest.mark.parametrize("case", range(len(BATCH)))
def test_sink_tokens_batch(case):
    b, sq, sk, mask, layout, dtype, cu_q, cu_k, path = BATCH[case]
    q, k, v = make_qkv(seed_of("sink-tokens", case), B=b, Hq=4, Hk=2, Sq=sq, Sk=sk, Dq=64, dtype=dtype, layout=layout)
    cq, ck = (None if x is None else _cu(x) for x in (cu_q, cu_k))
    kw = dict(mask=mask, layout=layout, cu_seqlen_q=cq, cu_seqlen_k=ck)
    assert fmha_iree.route(q, k, v, return_lse=True, **kw).path == path
    out, lse = fmha_iree.fmha_fwd(q, k, v, return_lse=True, **kw)
    ref_out, ref_lse = attention_ref(q, k, v, **kw)
    window, _ = attention_ref(q, k, v, **{**kw, "mask": mask.rsplit(",", 1)[0]})
    assert np.abs(ref_out - window).max() > 0.05  # the sink keys change these results
    assert_close(out, ref_out, dtype, what=f"sink tokens {path}")
    assert_close(lse, ref_lse, dtype, kind="lse", what=f"sink tokens {path}")


def test_sink_tokens_with_softcap_and_sinks():
    """The three variants together on torch tensors; a batch entry alone gives the same result."""
    q, k, v = make_qkv(seed_of("sink-tokens-all"), B=3, Hq=4, Hk=1, Sq=33, Sk=70, Dq=64, dtype=torch.float16,
                       layout="bshd")
    s = torch.randn(4, generator=torch.Generator().manual_seed(3)) * 2
    kw = dict(mask=Mask.window(16, 0, sink=4), layout="bshd", softcap=CAP, sinks=s)
    out, lse = fmha_iree.fmha_fwd(q, k, v, return_lse=True, **kw)
    ref_out, ref_lse = attention_ref(q, k, v, mask="b:16,0,4", layout="bshd", softcap=CAP, sinks=s.numpy())
    assert_close(out, ref_out, torch.float16, what="sink tokens + cap + sinks")
    assert_close(lse, ref_lse, torch.float16, kind="lse", what="sink tokens + cap + sinks")
    alone = fmha_iree.fmha_fwd(q[1:2], k[1:2], v[1:2], **kw)
    assert torch.equal(alone, out[1:2])


def test_sink_tokens_group_padded_starts():
    q, k, v, sq, sk = _group_inputs([5, 0, 40, 1], [30, 4, 60, 200])
    pad_q = np.array([3, 10, 12, 60, 70], np.int32)
    qp = torch.zeros(70, 4, 64, dtype=q.dtype)
    for b in range(4):
        qp[pad_q[b]:pad_q[b] + sq[b + 1] - sq[b]] = q[sq[b]:sq[b + 1]]
    kw = dict(seqstart_padded_q=pad_q, mask="b:8,0,3")
    out, lse = fmha_iree.fmha_fwd_varlen(qp, k, v, sq, sk, return_lse=True, **kw)
    ref_out, ref_lse = varlen_ref(qp, k, v, sq, sk, **kw)
    assert_close(out, ref_out, torch.float16, what="sink tokens group")
    assert_close(lse, ref_lse, torch.float16, kind="lse", what="sink tokens group")
    alone = fmha_iree.fmha_fwd_varlen(q[5:45], k[34:94], v[34:94], _cu([40]), _cu([60]), mask="b:8,0,3")
    assert torch.equal(alone, out[12:52])


def test_sink_tokens_paged_decode():
    q, (k, v, sk), (kc, vc, bt), sq = _paged_inputs([1, 1, 3], [300, 2, 130])
    lens = np.array([300, 2, 130], np.int32)
    out, lse = fmha_iree.fmha_fwd_varlen(q, kc, vc, sq, None, seqlen_k=lens, block_table=bt, mask="b:32,0,70",
                                         return_lse=True)
    ref_out, ref_lse = varlen_ref(q, k, v, sq, sk, mask="b:32,0,70")
    assert_close(out, ref_out, torch.float16, what="sink tokens paged")
    assert_close(lse, ref_lse, torch.float16, kind="lse", what="sink tokens paged")


@pytest.fixture(scope="module")
def capped_gpu():
    """The GPU formulation with the cap compiled in, built for llvm-cpu (``test_variants``' module:
    the same source, compiled once per machine)."""
    return gpu_formulation("f32", "bshd", 2, 64, softcap=CAP)


def test_sink_tokens_gpu_formulation(capped_gpu):
    """The sink keys added to the GPU formulation's window paths (``tiles`` in batch mode,
    ``ragged`` in group mode), the cap in both."""
    mask = Mask.from_str("b:24,0,5")
    q, k, v = make_qkv(seed_of("sink-tokens-gpu"), B=3, Hq=4, Hk=2, Sq=200, Sk=300, Dq=64, dtype=torch.float32,
                       layout="bshd")
    q, k, v = (x.numpy() for x in (q, k, v))
    cq, ck = _cu([200, 10, 50]), _cu([3, 300, 77])
    p = check_batch(q, k, v, mask=mask.window_only, scale=None, layout="bshd", cu_seqlen_q=cq, cu_seqlen_k=ck,
                    softcap=CAP)
    assert route(capped_gpu, p).path == "tiles"
    out, lse = batch_sink_tokens(*run_batch(capped_gpu, p), q, k, v, mask=mask, scale=p.scale, softcap=CAP,
                                 layout="bshd", q_lens=p.q_lens, k_lens=p.k_lens, return_lse=True)
    ref_out, ref_lse = attention_ref(q, k, v, mask=str(mask), layout="bshd", cu_seqlen_q=cq, cu_seqlen_k=ck,
                                     softcap=CAP)
    assert_close(out, ref_out, torch.float32, what="sink tokens gpu tiles")
    assert_close(lse, ref_lse, torch.float32, kind="lse", what="sink tokens gpu tiles")

    qg, kg, vg, sq, sk = (x.numpy() if isinstance(x, torch.Tensor) else x
                          for x in _group_inputs([12, 12], [12, 400], torch.float32))
    p, starts = check_varlen(qg, kg, vg, sq, sk, seqlen_k=None, seqstart_padded_q=None, seqstart_padded_k=None,
                             mask=mask.window_only, scale=None, softcap=CAP)
    out, lse = varlen_sink_tokens(*run_group(capped_gpu, p, starts), qg, kg, vg, mask=mask, scale=p.scale,
                                  softcap=CAP, starts=(*starts[:4], starts[4]), return_lse=True)
    ref_out, ref_lse = varlen_ref(qg, kg, vg, sq, sk, mask=str(mask), softcap=CAP)
    assert_close(out, ref_out, torch.float32, what="sink tokens gpu group")
    assert_close(lse, ref_lse, torch.float32, kind="lse", what="sink tokens gpu group")


def test_sink_tokens_torch_ops():
    from fmha_iree.integrations import torch_ops

    q, k, v = make_qkv(seed_of("sink-tokens-ops"), B=2, Hq=4, Hk=2, Sq=20, Sk=45, Dq=64, dtype=torch.float32)
    out = torch_ops.attention(q, k, v, mask="b:6,0,3")
    assert_close(out, attention_ref(q, k, v, mask="b:6,0,3")[0], torch.float32, what="attention wrapper")
    qg, kg, vg, sq, sk = _group_inputs([3, 9], [20, 9])
    out, lse = torch_ops.fmha_fwd_varlen(qg, kg, vg, torch.from_numpy(sq), torch.from_numpy(sk), mask="t:2,0,2",
                                         return_lse=True)
    ref_out, ref_lse = varlen_ref(qg, kg, vg, sq, sk, mask="t:2,0,2")
    assert_close(out, ref_out, torch.float16, what="varlen wrapper")
    assert_close(lse, ref_lse, torch.float16, kind="lse", what="varlen wrapper")


def test_mask_strings_and_refusals():
    assert Mask.from_str("b:4,0,2") == Mask(4, 0, False, 2) and str(Mask(4, 0, False, 2)) == "b:4,0,2"
    assert Mask(4, 0, False, 2).window_only == Mask(4, 0, False)
    vis = Mask.from_str("b:1,0,2").materialize(4, 6)  # rows see keys 0, 1 and their own window
    assert vis.tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 0, 1, 1, 0], [1, 1, 0, 0, 1, 1]]
    for bad, err in ((-1, ValueError), (True, TypeError), (2.0, TypeError)):
        with pytest.raises(err, match="sink"):
            Mask(4, 0, False, bad)
    with pytest.raises(ValueError, match="not a CK mask string"):
        Mask.from_str("b:4,0,-2")
    q, k, v = make_qkv(seed_of("sink-tokens-bad"), B=1, Hq=2, Sq=4, Sk=4, Dq=64, dtype=torch.float32)
    with pytest.raises(ValueError, match="sink tokens are added by"):  # the lower layers take windows only
        check_batch(q, k, v, mask="b:2,0,1", scale=None, layout="bhsd", cu_seqlen_q=None, cu_seqlen_k=None)
    out, _ = torch.ops.fmha_iree.fmha_fwd(q, k, v, "b:2,0,1", None, "bhsd", None)  # eager: the API's sum
    assert_close(out, attention_ref(q, k, v, mask="b:2,0,1")[0], torch.float32, what="eager op")
    from fmha_iree.integrations.model_op import site_mask

    with pytest.raises(ValueError, match="not supported inside an exported model"):  # not silently dropped
        site_mask("b:2,0,1")
    with pytest.raises(TypeError, match="DeviceTensors"):
        dq, dk, dv = (fmha_iree.to_device(x) for x in (q, k, v))
        fmha_iree.fmha_fwd(dq, dk, dv, mask="b:2,0,1")
