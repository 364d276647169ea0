"""fp8 K / V (an fp8 KV cache, issue 58): K and V in ``float8_e4m3fn`` / ``float8_e4m3fnuz`` with
per-tensor or per-KV-head descales, Q and the output f16 / bf16 / f32. Checked against the float64
reference computed on the dequantized values (each fp8 byte read by torch's own conversion, times
its head's factor) in batch mode (with and without ``cu_seqlen`` padding, decode, GQA, Sq != Sk,
each mask kind), group mode with padded starts, paged caches, deployed modules and the torch
wrappers, numpy (ml_dtypes) and torch inputs; a sequence's result is the same alone and in a batch
and between calls; refusals name the argument."""

import numpy as np
import pytest
import torch

import fmha_iree
from fmha_iree.problem.fp8 import fp8_values, used_pages
from fmha_iree.integrations import torch_ops
from reference import assert_close, attention_ref, make_qkv, seed_of, varlen_ref
from test_variants import _group_inputs, _paged_inputs

FMT = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e4m3fnuz": torch.float8_e4m3fnuz}


def _fp8(x, fmt, descale):
    """``x`` quantized as a KV cache is: ``x / descale`` saturated to ``fmt``'s largest finite
    value and rounded to it (torch's conversion turns values out of range into NaN)."""
    top = torch.finfo(FMT[fmt]).max
    return (x.float() / descale).clamp(-top, top).to(FMT[fmt])


def _deq(x8, descale, axis):
    """float64: torch's value of each fp8 element times its head's factor (the reference's K / V)."""
    y = x8.to(torch.float64)
    d = torch.as_tensor(descale, dtype=torch.float64)
    if d.dim():
        shape = [1] * y.dim()
        shape[axis] = -1
        d = d.view(shape)
    return y * d


@pytest.mark.parametrize("fmt", sorted(FMT))
def test_fp8_values_match_torch(fmt):
    """Every byte's value (subnormals, the largest, signed zeros, NaN) as torch reads it."""
    ours = fp8_values(fmt).astype(np.float64)
    theirs = torch.arange(256, dtype=torch.uint8).view(FMT[fmt]).to(torch.float64).numpy()
    assert np.array_equal(np.isnan(ours), np.isnan(theirs))
    ok = ~np.isnan(theirs)
    assert np.array_equal(ours[ok], theirs[ok])


BATCH = [  # (B, Hq, Hk, Sq, Sk, mask, layout, q dtype, format, descale kind, numpy inputs, cu_q, cu_k)
    (2, 4, 2, 1, 300, "b", "bshd", torch.float16, "float8_e4m3fn", "head", False, None, None),  # decode, GQA
    (2, 4, 4, 150, 130, "t", "bhsd", torch.bfloat16, "float8_e4m3fnuz", "scalar", False, None, None),  # Sq > Sk
    (1, 2, 1, 77, 200, "b:30,0", "bshd", torch.float32, "float8_e4m3fn", None, True, None, None),  # MQA, window
    (2, 4, 2, 90, 260, "0", "bhsd", torch.float16, "float8_e4m3fn", "head", True, [90, 17], [260, 60]),  # padding
    (3, 2, 2, 600, 600, "b", "bshd", torch.float16, "float8_e4m3fnuz", "head", False, None, None),  # long causal
]


@pytest.mark.parametrize("case", range(len(BATCH)))
def test_fp8_batch(case):
    b, hq, hk, sq, sk, mask, layout, dtype, fmt, kind, as_numpy, cu_q, cu_k = BATCH[case]
    q, k, v = make_qkv(seed_of("fp8", case), B=b, Hq=hq, Hk=hk, Sq=sq, Sk=sk, Dq=64, dtype=dtype, layout=layout)
    axis = 2 if layout == "bshd" else 1
    dk = {"head": torch.linspace(0.01, 0.05, hk), "scalar": 0.02, None: 1.0}[kind]
    dv = {"head": torch.linspace(0.03, 0.01, hk), "scalar": 0.5, None: 1.0}[kind]
    shape = [1] * 4
    shape[axis] = -1
    scale_k = torch.as_tensor(dk).view(shape) if kind == "head" else dk
    scale_v = torch.as_tensor(dv).view(shape) if kind == "head" else dv
    k8, v8 = _fp8(k, fmt, scale_k), _fp8(v * 3, fmt, scale_v)
    kw = dict(mask=mask, layout=layout, cu_seqlen_q=None if cu_q is None else np.cumsum([0] + cu_q),
              cu_seqlen_k=None if cu_k is None else np.cumsum([0] + cu_k))
    descales = {} if kind is None else dict(k_descale=dk.numpy() if as_numpy and kind == "head" else dk,
                                            v_descale=dv.numpy() if as_numpy and kind == "head" else dv)
    if as_numpy:
        import ml_dtypes

        to_np = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e4m3fnuz": ml_dtypes.float8_e4m3fnuz}[fmt]
        args = (q.numpy(), k8.view(torch.uint8).numpy().view(to_np), v8.view(torch.uint8).numpy().view(to_np))
    else:
        args = (q, k8, v8)
    out, lse = fmha_iree.fmha_fwd(*args, return_lse=True, **descales, **kw)
    ref_out, ref_lse = attention_ref(q, _deq(k8, dk, axis).numpy(), _deq(v8, dv, axis).numpy(),
                                     **{**kw, "mask": None if mask == "0" else mask})
    assert_close(out, ref_out, dtype, what=f"fp8 batch {case}")
    assert_close(lse, ref_lse, dtype, kind="lse", what=f"fp8 batch {case}")
    again = fmha_iree.fmha_fwd(*args, return_lse=True, **descales, **kw)
    assert np.array_equal(np.asarray(again[0], dtype=np.float64) if as_numpy else again[0].double().numpy(),
                          np.asarray(out, dtype=np.float64) if as_numpy else out.double().numpy(), equal_nan=True)


def test_fp8_group_padded_starts_and_invariance():
    """Group mode at padded starts (an empty sequence, one without keys): against float64, a
    repeated call bitwise equal, and sequence 1 alone bitwise equal to its rows in the batch."""
    lq, lk = [5, 100, 0, 1, 64], [40, 100, 3, 0, 300]
    q, k, v, sq, sk = _group_inputs(lq, lk, gain=1.0)
    dk, dv = torch.tensor([0.02, 0.04]), torch.tensor([0.05, 0.01])
    k8, v8 = _fp8(k, "float8_e4m3fn", dk.view(1, -1, 1)), _fp8(v, "float8_e4m3fn", dv.view(1, -1, 1))
    pad_q = np.array([0, 8, 110, 110, 115, 179], np.int32)
    qp = torch.zeros(179, q.shape[1], q.shape[2], dtype=q.dtype)
    for b in range(len(lq)):
        qp[pad_q[b]:pad_q[b] + lq[b]] = q[sq[b]:sq[b + 1]]
    kw = dict(mask="b", seqstart_padded_q=pad_q, return_lse=True, k_descale=dk, v_descale=dv)
    out, lse = fmha_iree.fmha_fwd_varlen(qp, k8, v8, sq, sk, **kw)
    ref_out, ref_lse = varlen_ref(qp, _deq(k8, dk, 1), _deq(v8, dv, 1), sq, sk, mask="b", seqstart_padded_q=pad_q)
    assert_close(out, ref_out, q.dtype, what="fp8 group")
    assert_close(lse, ref_lse, q.dtype, kind="lse", what="fp8 group")
    assert torch.equal(fmha_iree.fmha_fwd_varlen(qp, k8, v8, sq, sk, **kw)[0], out)
    b = 1
    alone, alone_lse = fmha_iree.fmha_fwd_varlen(q[sq[b]:sq[b + 1]], k8[sk[b]:sk[b + 1]], v8[sk[b]:sk[b + 1]],
                                                 np.array([0, lq[b]]), np.array([0, lk[b]]), mask="b",
                                                 return_lse=True, k_descale=dk, v_descale=dv)
    assert torch.equal(alone, out[pad_q[b]:pad_q[b] + lq[b]])
    assert torch.equal(alone_lse, lse[:, sq[b]:sq[b + 1]])


@pytest.mark.parametrize("lq,lk,path", [([1, 1, 2], [300, 1, 64], "cpu_pages"), ([100, 1], [300, 1], "cpu_gather")])
def test_fp8_paged(lq, lk, path):
    """A paged fp8 cache whose unused pages hold NaN bytes: only the used pages are read."""
    q, (k, v, sk), (kc, vc, bt), sq = _paged_inputs(lq, lk)
    dk, dv = 0.03, torch.tensor([0.02, 0.05])
    kc8, vc8 = _fp8(kc, "float8_e4m3fn", dk), _fp8(vc, "float8_e4m3fn", dv.view(1, 1, -1, 1))
    spare = torch.full((3,) + tuple(kc8.shape[1:]), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)
    kc8, vc8 = torch.cat([kc8, spare]), torch.cat([vc8, spare])  # NaN pages no sequence uses
    lens = np.asarray(lk, np.int32)
    kw = dict(seqlen_k=lens, block_table=bt, mask="b", return_lse=True, k_descale=dk, v_descale=dv)
    r = fmha_iree.route(q, kc8, vc8, seqstart_q=sq, **kw)
    assert r.path == path, str(r)
    out, lse = fmha_iree.fmha_fwd_varlen(q, kc8, vc8, sq, None, **kw)
    k8, v8 = _fp8(k, "float8_e4m3fn", dk), _fp8(v, "float8_e4m3fn", dv.view(1, -1, 1))
    ref_out, ref_lse = varlen_ref(q, _deq(k8, dk, 1), _deq(v8, dv, 1), sq, sk, mask="b")
    assert_close(out, ref_out, torch.float16, what=f"fp8 {path}")
    assert_close(lse, ref_lse, torch.float16, kind="lse", what=f"fp8 {path}")


def test_used_pages():
    """The pages a block table uses for each sequence's keys (entries past them are not read, -1
    there included), and the table renumbered onto them."""
    table = np.array([[7, 2, -1], [2, 5, 9], [0, -1, -1]], np.int32)
    lens = np.array([65, 64, 0])
    pages, renumbered = used_pages(table, lens, 64, 10)
    want = sorted({7, 2} | {2})
    assert pages.tolist() == want
    for b, n in enumerate([2, 1, 0]):
        assert [int(pages[renumbered[b, j]]) for j in range(n)] == table[b, :n].tolist()
    assert used_pages(table, np.array([65, 64, 129]), 64, 10) is None  # -1 used: the cache's checks name it


def test_fp8_torch_wrappers_and_compile():
    """``torch_ops.attention`` (eager and ``torch.compile(fullgraph=True)``) and
    ``torch_ops.fmha_fwd_varlen`` over a paged fp8 cache."""
    q, k, v = make_qkv(seed_of("fp8-torch"), B=2, Hq=4, Hk=2, Sq=40, Sk=90, dtype=torch.float16)
    dk = torch.tensor([0.02, 0.03])
    k8, v8 = _fp8(k, "float8_e4m3fn", dk.view(1, -1, 1, 1)), _fp8(v, "float8_e4m3fn", 0.05)
    ref_out, _ = attention_ref(q, _deq(k8, dk, 1).numpy(), _deq(v8, 0.05, 1).numpy(), mask="b")
    out = torch_ops.attention(q, k8, v8, mask="b", k_descale=dk, v_descale=0.05)
    assert_close(out, ref_out, torch.float16, what="fp8 attention")
    fn = torch.compile(lambda a, b_, c: torch_ops.attention(a, b_, c, mask="b", k_descale=dk, v_descale=0.05),
                       fullgraph=True)
    assert torch.equal(fn(q, k8, v8), out)
    lq, lk = [1, 2], [100, 64]
    qv, (kp, vp, sk), (kc, vc, bt), sq = _paged_inputs(lq, lk)
    kc8, vc8 = _fp8(kc, "float8_e4m3fnuz", 0.04), _fp8(vc, "float8_e4m3fnuz", 0.04)
    got = torch_ops.fmha_fwd_varlen(qv, kc8, vc8, torch.as_tensor(sq, dtype=torch.int32), None,
                                    seqlen_k=torch.tensor(lk, dtype=torch.int32), block_table=torch.as_tensor(bt),
                                    mask="b", k_descale=0.04, v_descale=0.04)
    k8, v8 = _fp8(kp, "float8_e4m3fnuz", 0.04), _fp8(vp, "float8_e4m3fnuz", 0.04)
    ref, _ = varlen_ref(qv, _deq(k8, 0.04, 1), _deq(v8, 0.04, 1), sq, sk, mask="b")
    assert_close(got, ref, torch.float16, what="fp8 torch varlen paged")


def test_fp8_deployed(tmp_path):
    """A deployed module (no compiler needed at the call) takes fp8 K / V with descales in batch
    and group mode."""
    from fmha_iree.cli import main

    path = tmp_path / "m.vmfb"
    assert main(["compile", "--target", "host", "--dtype", "f16", "--layout", "bshd", "--hdim", "64", "--heads", "4:2",
                 "--mask", "b", "-o", str(path)]) == 0
    mod = fmha_iree.load(path)
    q, k, v = make_qkv(seed_of("fp8-deploy"), B=2, Hq=4, Hk=2, Sq=3, Sk=200, dtype=torch.float16, layout="bshd")
    dk = torch.tensor([0.02, 0.03])
    k8, v8 = _fp8(k, "float8_e4m3fn", dk.view(1, 1, -1, 1)), _fp8(v, "float8_e4m3fn", 0.05)
    out = mod(q, k8, v8, k_descale=dk, v_descale=0.05)
    ref, _ = attention_ref(q, _deq(k8, dk, 2).numpy(), _deq(v8, 0.05, 2).numpy(), mask="b", layout="bshd")
    assert_close(out, ref, torch.float16, what="fp8 deployed")
    sq, sk = np.array([0, 3, 6]), np.array([0, 200, 400])
    got = mod.varlen(q.reshape(6, 4, 64), k8.reshape(400, 2, 64), v8.reshape(400, 2, 64), sq, sk,
                     k_descale=dk, v_descale=0.05)
    assert_close(got, ref.reshape(6, 4, 64), torch.float16, what="fp8 deployed varlen")


def _refusal_args():
    q, k, v = make_qkv(1, B=1, Hq=2, Hk=2, Sq=4, Sk=8, dtype=torch.float16)
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    return q, k, v, k8, v8


@pytest.mark.parametrize("change,error,words", [
    (lambda q, k, v, k8, v8: (q, k8, v, {}), TypeError, "k and v must both be fp8"),
    (lambda q, k, v, k8, v8: (q, k8, v8.to(torch.float8_e4m3fnuz), {}), TypeError, "one format"),
    (lambda q, k, v, k8, v8: (q.to(torch.float8_e4m3fn), k8, v8, {}), TypeError, "q has dtype"),
    (lambda q, k, v, k8, v8: (q.numpy(), k8, v8, {}), TypeError, "must all be torch tensors or all numpy"),
    (lambda q, k, v, k8, v8: (q, k, v, dict(k_descale=0.5)), ValueError, "k_descale / v_descale are for fp8"),
    (lambda q, k, v, k8, v8: (q, k8, v8, dict(k_descale=torch.ones(3))), ValueError, "k_descale must be a scalar"),
    (lambda q, k, v, k8, v8: (q, k8, v8, dict(v_descale=-1.0)), ValueError, "v_descale must be finite and positive"),
    (lambda q, k, v, k8, v8: (q, k8, v8, dict(v_descale=float("nan"))), ValueError, "v_descale must be finite"),
    (lambda q, k, v, k8, v8: (q, k8, v8, dict(k_descale="1")), TypeError, "k_descale must be a float"),
    (lambda q, k, v, k8, v8: (q, k8, v8, dict(k_descale=torch.ones(2, dtype=torch.int32))), TypeError, "k_descale must hold floats"),
])
def test_fp8_refused(change, error, words):
    q, k, v, kw = change(*_refusal_args())
    with pytest.raises(error, match=words):
        fmha_iree.fmha_fwd(q, k, v, **kw)


class _Fp8Model(torch.nn.Module):
    def forward(self, q, k8, v8, dk):
        return torch_ops.attention(q, k8, v8, mask="b", layout="bshd", k_descale=dk, v_descale=0.05)


def test_fp8_exported_model(tmp_path):
    """A model taking an fp8 KV cache, exported with iree-turbine and run through iree.runtime
    alone: the dequantization is torch ops of its graph (through float32: IREE's llvm-cpu converts
    no fp8 to f16 directly), the same values as eager."""
    import iree.runtime as rt
    from fmha_iree.integrations.model_export import compile_model, export_model

    q, k, v = make_qkv(seed_of("fp8-export"), B=1, Hq=4, Hk=2, Sq=5, Sk=9, dtype=torch.float16, layout="bshd")
    dk = torch.tensor([0.02, 0.03])
    k8, v8 = _fp8(k, "float8_e4m3fn", dk.view(1, 1, -1, 1)), _fp8(v, "float8_e4m3fn", 0.05)
    path = tmp_path / "fp8_model.vmfb"
    compile_model(export_model(_Fp8Model(), (q, k8, v8, dk), target="host"), target="host", output=str(path))
    vmfb = path.read_bytes()
    cfg = rt.Config("local-task")
    ctx = rt.SystemContext(config=cfg)
    ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, vmfb))
    fp8_views = [cfg.device.allocator.allocate_buffer_copy(
        memory_type=rt.MemoryType.DEVICE_LOCAL, allowed_usage=rt.BufferUsage.DEFAULT, device=cfg.device,
        buffer=x.view(torch.uint8).numpy(), element_type=rt.HalElementType.FLOAT_8_E4M3_FN) for x in (k8, v8)]
    got = np.asarray(ctx.modules.module["main"](q.numpy(), *fp8_views, dk.numpy()).to_host())
    ref, _ = attention_ref(q, _deq(k8, dk, 2).numpy(), _deq(v8, 0.05, 2).numpy(), mask="b", layout="bshd")
    assert_close(got, ref, torch.float16, what="fp8 exported model")
    assert np.array_equal(got, _Fp8Model()(q, k8, v8, dk).numpy())
