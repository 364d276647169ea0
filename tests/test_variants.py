"""The attention variants on every path: the logits soft-cap (a module constant, in the score stage
every kernel shares) and attention sinks (``paths.sinks``, applied to any path's results), against
the float64 reference extended with both (``reference.attention_ref``).

Each case names the path it must take (``route``), so a change of router that moves a problem off
the path under test fails here rather than testing another path twice. The GPU formulation's paths
(``fwd``, ``tiles``, ``packed``, ``ragged``) run on its llvm-cpu build with a soft-cap compiled in.
"""

import numpy as np
import pytest
import torch

import fmha_iree
from common import gpu_formulation, route, run_batch, run_group
from fmha_iree.problem.paged import check_paged
from fmha_iree.problem.spec import check_batch, check_varlen
from reference import assert_close, attention_ref, make_qkv, seed_of, varlen_ref

CAP = 4.0  # small enough that tanh bends most scores of these inputs (scaled by 3 below)


def _cu(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _batch_inputs(b, sq, sk, layout, dtype, hq=4, hk=2, gain=3.0):
    q, k, v = make_qkv(seed_of("variants", b, sq, sk, layout, str(dtype)), B=b, Hq=hq, Hk=hk, Sq=sq, Sk=sk, Dq=64,
                       dtype=dtype, layout=layout)
    return (q.float() * gain).to(dtype), k, v


BATCH_CASES = [  # (B, Sq, Sk, mask, layout, dtype, cu_q, cu_k, specialize, path)
    (2, 30, 300, "b", "bhsd", torch.float32, None, None, False, "rows"),
    (2, 300, 300, "t", "bhsd", torch.float32, None, None, False, "cpu_group"),
    (2, 300, 3000, "xb:200", "bhsd", torch.float32, None, None, False, "units"),
    (2, 600, 900, "b", "bhsd", torch.float32, None, [900, 5], False, "plan"),
    (1, 256, 256, "t", "bhsd", torch.float32, None, None, True, "compiled_in"),
    (2, 40, 20, "b", "bshd", torch.float16, [40, 7], None, False, "rows"),
]


@pytest.mark.parametrize("case", range(len(BATCH_CASES)))
def test_softcap_batch_paths(case):
    b, sq, sk, mask, layout, dtype, cu_q, cu_k, spec, path = BATCH_CASES[case]
    q, k, v = _batch_inputs(b, sq, sk, layout, dtype)
    cq, ck = (None if x is None else _cu(x) for x in (cu_q, cu_k))
    kw = dict(mask=mask, layout=layout, cu_seqlen_q=cq, cu_seqlen_k=ck, specialize=spec, softcap=CAP)
    r = fmha_iree.route(q, k, v, return_lse=True, **kw)
    assert r.path == path, str(r)
    out, lse = fmha_iree.fmha_fwd(q, k, v, return_lse=True, **kw)
    ref_out, ref_lse = attention_ref(q, k, v, mask=mask, layout=layout, cu_seqlen_q=cq, cu_seqlen_k=ck, softcap=CAP)
    plain, _ = attention_ref(q, k, v, mask=mask, layout=layout, cu_seqlen_q=cq, cu_seqlen_k=ck)
    assert np.abs(ref_out - plain).max() > 0.1  # the cap changes these results
    assert_close(out, ref_out, dtype, what=f"softcap {path}")
    assert_close(lse, ref_lse, dtype, kind="lse", what=f"softcap {path}")


def _group_inputs(lq, lk, dtype=torch.float16, gain=3.0):
    sq, sk = _cu(lq), _cu(lk)
    g = torch.Generator().manual_seed(seed_of("variants-group", tuple(lq), tuple(lk)))
    q = (torch.randn(int(sq[-1]), 4, 64, generator=g) * gain).to(dtype)
    k = torch.randn(max(int(sk[-1]), 1), 2, 64, generator=g).to(dtype)
    v = torch.randn(max(int(sk[-1]), 1), 2, 64, generator=g).to(dtype)
    return q, k, v, sq, sk


def check_group_invariance(what, inputs, lq, lk, variant: dict, alone_variant):
    """Group mode with the sequences of ``lq`` / ``lk`` (``_group_inputs``) at padded starts (gaps
    between them) and ``variant``'s arguments, against float64; a repeated call is bitwise equal,
    and sequence 1 alone (``alone_variant(1)``'s arguments) bitwise equal to its rows in the batch."""
    q, k, v, sq, sk = inputs
    pad_q = np.array([0, 8, 110, 110, 115, 179], np.int32)
    qp = torch.zeros(179, q.shape[1], q.shape[2], dtype=q.dtype)
    for b in range(len(lq)):
        qp[pad_q[b]:pad_q[b] + lq[b]] = q[sq[b]:sq[b + 1]]
    kw = dict(mask="b", seqstart_padded_q=pad_q, return_lse=True)
    out, lse = fmha_iree.fmha_fwd_varlen(qp, k, v, sq, sk, **variant, **kw)
    ref_out, ref_lse = varlen_ref(qp, k, v, sq, sk, mask="b", seqstart_padded_q=pad_q, **variant)
    assert_close(out, ref_out, q.dtype, what=what)
    assert_close(lse, ref_lse, q.dtype, kind="lse", what=what)
    again, _ = fmha_iree.fmha_fwd_varlen(qp, k, v, sq, sk, **variant, **kw)
    assert torch.equal(again, out)
    b = 1
    alone, alone_lse = fmha_iree.fmha_fwd_varlen(q[sq[b]:sq[b + 1]], k[sk[b]:sk[b + 1]], v[sk[b]:sk[b + 1]],
                                                 np.array([0, lq[b]]), np.array([0, lk[b]]), mask="b",
                                                 return_lse=True, **alone_variant(b))
    assert torch.equal(alone, out[pad_q[b]:pad_q[b] + lq[b]])
    assert torch.equal(alone_lse, lse[:, sq[b]:sq[b + 1]])


def variant_module(path, flag: str, heads: str):
    """A host f16 bshd d64 module compiled with ``flag`` (``--alibi``, ``--bias``) and ``heads``:
    its manifest records the variant, and it holds ``fwd_tiles`` alone (with its paged and short
    forms)."""
    from fmha_iree.cli import main

    assert main(["compile", "--target", "host", "--dtype", "f16", "--layout", "bshd", "--hdim", "64", "--heads", heads,
                 "--mask", "b", flag, "-o", str(path)]) == 0
    mod = fmha_iree.load(path)
    assert mod.manifest["variants"][flag[2:]] is True
    assert mod.capabilities.entries == {"fwd_tiles", "fwd_tiles_paged", "fwd_tiles_short", "fwd_tiles_short_paged"}
    return mod


def _paged_inputs(lq, lk, page=64, dtype=torch.float16):
    """A paged cache holding sequences of ``lk`` keys in shuffled pages, and its packed twin."""
    q, k, v, sq, sk = _group_inputs(lq, lk, dtype)
    n = [-(-x // page) for x in lk]
    order = np.random.default_rng(seed_of("pages", tuple(lk))).permutation(sum(n) + 1)
    bt = np.zeros((len(lk), max(max(n), 1)), np.int32)
    kc = torch.zeros(sum(n) + 1, page, 2, 64, dtype=dtype)
    vc = torch.zeros_like(kc)
    at = 0
    for b, m in enumerate(n):
        bt[b, :m] = order[at:at + m]
        for j in range(m):
            rows = slice(int(sk[b]) + j * page, min(int(sk[b]) + (j + 1) * page, int(sk[b + 1])))
            cnt = rows.stop - rows.start
            kc[bt[b, j], :cnt], vc[bt[b, j], :cnt] = k[rows], v[rows]
        at += m
    return q, (k, v, sk), (kc, vc, bt), sq


GROUP_CASES = [  # (lq, lk, mask, path)
    ([700, 64, 3], [700, 64, 300], "b", "cpu_group"),
    ([1, 1, 2, 9], [300, 1, 64, 0], "t", "cpu_group"),
]


@pytest.mark.parametrize("case", range(len(GROUP_CASES)))
def test_softcap_group_paths(case):
    lq, lk, mask, path = GROUP_CASES[case]
    q, k, v, sq, sk = _group_inputs(lq, lk)
    r = fmha_iree.route(q, k, v, seqstart_q=sq, seqstart_k=sk, mask=mask, return_lse=True, softcap=CAP)
    assert r.path == path, str(r)
    out, lse = fmha_iree.fmha_fwd_varlen(q, k, v, sq, sk, mask=mask, return_lse=True, softcap=CAP)
    ref_out, ref_lse = varlen_ref(q, k, v, sq, sk, mask=mask, softcap=CAP)
    assert_close(out, ref_out, torch.float16, what="softcap group")
    assert_close(lse, ref_lse, torch.float16, kind="lse", what="softcap group")


@pytest.mark.parametrize("lq,lk,path", [([1, 1, 2], [300, 1, 64], "cpu_pages"), ([100, 1], [300, 1], "cpu_gather")])
def test_softcap_paged_paths(lq, lk, path):
    q, (k, v, sk), (kc, vc, bt), sq = _paged_inputs(lq, lk)
    lens = np.asarray(lk, np.int32)
    kw = dict(seqlen_k=lens, block_table=bt, mask="b", return_lse=True, softcap=CAP)
    r = fmha_iree.route(q, kc, vc, seqstart_q=sq, **kw)
    assert r.path == path, str(r)
    out, lse = fmha_iree.fmha_fwd_varlen(q, kc, vc, sq, None, **kw)
    ref_out, ref_lse = varlen_ref(q, k, v, sq, sk, mask="b", softcap=CAP)
    assert_close(out, ref_out, torch.float16, what=f"softcap {path}")
    assert_close(lse, ref_lse, torch.float16, kind="lse", what=f"softcap {path}")


@pytest.fixture(scope="module")
def capped_gpu():
    """The GPU formulation (``fwd``, ``fwd_tiles``, ``fwd_packed*``, ``fwd_ragged``) with the cap
    compiled in, built for llvm-cpu."""
    return gpu_formulation("f32", "bshd", 2, 64, softcap=CAP)


def _np(x):
    return x.numpy() if isinstance(x, torch.Tensor) else x


GPU_BATCH = [  # (B, Sq, Sk, mask, cu_q, cu_k, path)
    (2, 150, 200, "t:20,30", None, None, "fwd"),
    (3, 200, 300, "b", [200, 10, 50], [3, 300, 77], "tiles"),
    (3, 1, 300, "b", [1, 1, 1], [3, 300, 77], "packed"),
    (2, 128, 192, "0", None, None, "dense"),
]


@pytest.mark.parametrize("case", range(len(GPU_BATCH)))
def test_softcap_gpu_batch_paths(capped_gpu, case):
    b, sq, sk, mask, cu_q, cu_k, path = GPU_BATCH[case]
    q, k, v = (_np(x) for x in _batch_inputs(b, sq, sk, "bshd", torch.float32))
    cq, ck = (None if x is None else _cu(x) for x in (cu_q, cu_k))
    p = check_batch(q, k, v, mask=mask, scale=None, layout="bshd", cu_seqlen_q=cq, cu_seqlen_k=ck, softcap=CAP)
    assert route(capped_gpu, p).path == path
    out, lse = run_batch(capped_gpu, p)
    ref_out, ref_lse = attention_ref(q, k, v, mask=mask, layout="bshd", cu_seqlen_q=cq, cu_seqlen_k=ck, softcap=CAP)
    assert_close(out, ref_out, torch.float32, what=f"softcap gpu {path}")
    assert_close(lse, ref_lse, torch.float32, kind="lse", what=f"softcap gpu {path}")


@pytest.mark.parametrize("lq,lk,path", [([12, 12], [12, 400], "ragged"), ([1] * 5, [5, 600, 64, 0, 300], "packed")])
def test_softcap_gpu_group_paths(capped_gpu, lq, lk, path):
    q, k, v, sq, sk = (_np(x) for x in _group_inputs(lq, lk, torch.float32))
    p, starts = check_varlen(q, k, v, sq, sk, seqlen_k=None, seqstart_padded_q=None, seqstart_padded_k=None,
                             mask="b", scale=None, softcap=CAP)
    from fmha_iree import paths

    assert paths.group_route(p, starts, True, lambda: capped_gpu).path == path
    out, lse = run_group(capped_gpu, p, starts)
    ref_out, ref_lse = varlen_ref(q, k, v, sq, sk, mask="b", softcap=CAP)
    assert_close(out, ref_out, torch.float32, what=f"softcap gpu group {path}")
    assert_close(lse, ref_lse, torch.float32, kind="lse", what=f"softcap gpu group {path}")


def test_softcap_gpu_paged(capped_gpu):
    q, (k, v, sk), (kc, vc, bt), sq = _paged_inputs([1, 1, 2], [300, 1, 64], dtype=torch.float32)
    lens = np.asarray([300, 1, 64], np.int32)
    cache = check_paged(kc.numpy(), vc.numpy(), sq, None, lens, None, bt)
    from fmha_iree import paths

    prob = paths.paged_problem(q.numpy(), cache, sq, None, mask="b", scale=None, with_lse=True, softcap=CAP)
    out, lse = paths.run_paged(prob, lambda: capped_gpu)
    ref_out, ref_lse = varlen_ref(q, k, v, sq, sk, mask="b", softcap=CAP)
    assert_close(out, ref_out, torch.float32, what="softcap gpu paged")
    assert_close(lse, ref_lse, torch.float32, kind="lse", what="softcap gpu paged")


# ---- sinks -----------------------------------------------------------------------------------

def _sinks(hq, seed=0):
    return torch.randn(hq, generator=torch.Generator().manual_seed(seed)) * 2


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("numpy_in", [False, True], ids=["torch", "numpy"])
def test_sinks_batch(layout, numpy_in):
    """Rows that see no key (Sq > Sk, bottom-right) and padding rows take the sink as LSE."""
    q, k, v = _batch_inputs(2, 40, 20, layout, torch.float32, hq=4, hk=4, gain=1.0)
    cq = _cu([40, 25])
    s = _sinks(4)
    args = tuple(x.numpy() for x in (q, k, v)) if numpy_in else (q, k, v)
    out, lse = fmha_iree.fmha_fwd(*args, mask="b", layout=layout, cu_seqlen_q=cq, return_lse=True,
                                  sinks=s.numpy() if numpy_in else s)
    assert isinstance(out, np.ndarray) == numpy_in
    ref_out, ref_lse = attention_ref(q, k, v, mask="b", layout=layout, cu_seqlen_q=cq, sinks=s)
    assert np.isfinite(ref_lse).all()  # every row, empty ones included, has the sink
    assert_close(out, ref_out, torch.float32, what="sinks")
    assert_close(lse, ref_lse, torch.float32, kind="lse", what="sinks")
    only = fmha_iree.fmha_fwd(*args, mask="b", layout=layout, cu_seqlen_q=cq, sinks=s)
    assert np.array_equal(_np(only), _np(out))  # return_lse=False: the same out


def test_sinks_with_softcap_group_padded_starts():
    """Group mode with gaps between sequences (out rows elsewhere than the LSE's columns), the cap
    and the sinks together; a sequence's result is the same alone and in the batch."""
    q, k, v, sq, sk = _group_inputs([5, 0, 9], [30, 4, 0])
    pad_q = np.array([3, 10, 12, 25], np.int32)
    qp = torch.zeros(25, 4, 64, dtype=q.dtype)
    for b in range(3):
        qp[pad_q[b]:pad_q[b] + sq[b + 1] - sq[b]] = q[sq[b]:sq[b + 1]]
    s = _sinks(4, 1)
    out, lse = fmha_iree.fmha_fwd_varlen(qp, k, v, sq, sk, seqstart_padded_q=pad_q, mask="t", return_lse=True,
                                         softcap=CAP, sinks=s)
    ref_out, ref_lse = varlen_ref(qp, k, v, sq, sk, seqstart_padded_q=pad_q, mask="t", softcap=CAP, sinks=s)
    assert_close(out, ref_out, torch.float16, what="sinks group")
    assert_close(lse, ref_lse, torch.float16, kind="lse", what="sinks group")
    alone = fmha_iree.fmha_fwd_varlen(q[:5], k[:30], v[:30], _cu([5]), _cu([30]), mask="t", softcap=CAP, sinks=s)
    assert torch.equal(alone, out[3:8])


def test_sinks_paged():
    q, (k, v, sk), (kc, vc, bt), sq = _paged_inputs([1, 3], [130, 64])
    s = _sinks(4, 2)
    out, lse = fmha_iree.fmha_fwd_varlen(q, kc, vc, sq, None, seqlen_k=np.array([130, 64], np.int32), block_table=bt,
                                         mask="b", return_lse=True, sinks=s)
    ref_out, ref_lse = varlen_ref(q, k, v, sq, sk, mask="b", sinks=s)
    assert_close(out, ref_out, torch.float16, what="sinks paged")
    assert_close(lse, ref_lse, torch.float16, kind="lse", what="sinks paged")


@pytest.mark.parametrize("value,error,words", [
    (0.0, ValueError, "softcap must be positive"), (-3.0, ValueError, "softcap must be positive"),
    (float("nan"), ValueError, "softcap"), (True, TypeError, "softcap"), ("50", TypeError, "softcap")])
def test_softcap_refused(value, error, words):
    q, k, v = _batch_inputs(1, 4, 4, "bhsd", torch.float32)
    with pytest.raises(error, match=words):
        fmha_iree.fmha_fwd(q, k, v, softcap=value)


@pytest.mark.parametrize("value,error,words", [
    (torch.zeros(3), ValueError, r"sinks must have shape \[4\]"), (torch.zeros(4, 1), ValueError, "sinks"),
    (torch.zeros(4, dtype=torch.int32), TypeError, "sinks must hold floats"), ("x", TypeError, "sinks"),
    (np.array(["a"] * 4), TypeError, "sinks")])
def test_sinks_refused(value, error, words):
    q, k, v = _batch_inputs(1, 4, 4, "bhsd", torch.float32)
    with pytest.raises(error, match=words):
        fmha_iree.fmha_fwd(q, k, v, sinks=value)
    with pytest.raises(TypeError, match="DeviceTensors"):
        dq, dk, dv = (fmha_iree.to_device(x) for x in (q, k, v))
        fmha_iree.fmha_fwd(dq, dk, dv, sinks=torch.zeros(4))
