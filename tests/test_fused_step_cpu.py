"""The GPU formulation (the fused ``online_attention`` templates: the plan's ``step``, the aligned
``dense`` and the compiled-in lengths' entry points) checked for numbers on the CPU, where CI runs: the
module is built exactly as for gfx/CUDA targets but for llvm-cpu, then driven through the same
API code as any module and compared with the float64 reference."""

import numpy as np
import pytest
import torch

import fmha_iree
from fmha_iree.toolchain.compile import ASYNC_FLAGS, compile_flags
from fmha_iree.codegen.source import source_mlir
from fmha_iree.runtime.device import DeviceTensor
from fmha_iree.problem.spec import KernelSpec, check_batch
from fmha_iree.problem.targets import Target

from common import bind, route, run_batch
from reference import assert_close, attention_ref, make_qkv, seed_of

# Small units so a few hundred rows cross several tiles and key chunks. The dense path then takes
# lengths that are multiples of 32.
TILES = fmha_iree.TileConfig(m0=32, n0=32, k0=16, n1=64, k1=16, kv_chunk=64)


@pytest.fixture(scope="module")
def fused_module():
    import iree.compiler.tools as ict

    mods = {}

    def get(dtype, layout, group, d, dv=None, seqlens=()):
        key = (dtype, layout, group, d, dv, seqlens)
        if key not in mods:
            spec = KernelSpec(dtype, layout, group, d, dv or d, TILES, Target.from_name("host"), seqlens)
            # compiled as GPU modules are: asynchronous entry points, chained through fences
            # without fwd (tests/test_fwd_cpu.py): these tests drive the plan's step and the
            # aligned one-call entry points, which fwd would take over
            vmfb = ict.compile_str(source_mlir(spec, fused_step=True, with_fwd=False),
                                   extra_args=compile_flags(spec) + ASYNC_FLAGS)
            mods[key] = bind(vmfb, spec)
        return mods[key]

    return get


def _run(mod, q, k, v, mask, layout="bhsd", **kw):
    p = check_batch(q, k, v, mask=mask, scale=None, layout=layout, cu_seqlen_q=kw.get("cu_q"), cu_seqlen_k=kw.get("cu_k"))
    return p, run_batch(mod, p)


@pytest.mark.parametrize("mask", ["0", "b", "t", "b:20,0", "t:3,40", "xb:9"])
@pytest.mark.parametrize("sq,sk", [(77, 130), (130, 77), (200, 200)], ids=["77x130", "130x77", "200x200"])
def test_fused_step_matches_reference(fused_module, mask, sq, sk):
    q, k, v = make_qkv(seed_of("fused", mask, sq, sk), B=2, Hq=4, Hk=2, Sq=sq, Sk=sk, Dq=64)
    mod = fused_module("f32", "bhsd", 2, 64)
    p, (out, lse) = _run(mod, q, k, v, mask)
    assert route(mod, p).path == "plan"  # unaligned lengths: the plan's step
    ref_out, ref_lse = attention_ref(q, k, v, mask=mask)
    assert_close(out, ref_out, torch.float32, what=f"fused out mask={mask}")
    assert_close(lse, ref_lse, torch.float32, kind="lse", what=f"fused lse mask={mask}")


def test_fused_step_padding_and_f16_bshd(fused_module):
    q, k, v = make_qkv(seed_of("fused-pad"), B=2, Hq=2, Hk=2, Sq=90, Sk=120, Dq=64, dtype=torch.float16)
    k[1, :, 100:] = float("nan")  # padding past cu_seqlen_k is never read
    v[1, :, 100:] = float("nan")
    cu_k = np.array([0, 120, 220], np.int32)
    qs, ks, vs = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    mod = fused_module("f16", "bshd", 1, 64)
    _, (out, lse) = _run(mod, qs, ks, vs, "b", layout="bshd", cu_k=cu_k)
    ref_out, ref_lse = attention_ref(qs, ks, vs, mask="b", layout="bshd", cu_seqlen_k=cu_k)
    assert_close(out, ref_out, torch.float16, what="fused f16 bshd padded")
    assert_close(lse, ref_lse, torch.float16, kind="lse", what="fused f16 bshd padded lse")


@pytest.mark.parametrize("mask,sq,sk", [("b", 77, 130), ("t:3,40", 130, 77), ("0", 50, 200), ("b:20,5", 90, 90)],
                         ids=["b-77x130", "t-130x77", "0-50x200", "window-90x90"])
def test_fused_step_padded_head_dims(fused_module, mask, sq, sk):
    """Head dims without tiles of their own (Dq 96, Dv 192) are computed zero-padded to 128 / 256
    by the step (source.step_compute): Q / K / V gathered with zero columns, the output cut back
    to Dv; GQA, bshd, f16."""
    q, k, v = make_qkv(seed_of("fused-padded", mask, sq, sk), B=2, Hq=4, Hk=2, Sq=sq, Sk=sk, Dq=96, Dv=192,
                       layout="bshd", dtype=torch.float16)
    mod = fused_module("f16", "bshd", 2, 96, 192)
    p, (out, lse) = _run(mod, q, k, v, mask, layout="bshd")
    assert route(mod, p).path == "plan" and out.shape[-1] == 192
    ref_out, ref_lse = attention_ref(q, k, v, mask=mask, layout="bshd")
    assert_close(out, ref_out, torch.float16, what=f"padded-dims out mask={mask}")
    assert_close(lse, ref_lse, torch.float16, kind="lse", what=f"padded-dims lse mask={mask}")


# The one-call entry points: aligned lengths, every layout, GQA, dtype; the mask decides the path.
DENSE_CASES = [
    # (mask, sq, sk, expected path)
    ("0", 96, 160, "dense"),
    ("0", 160, 64, "dense"),
    ("b", 256, 256, "plan"),  # causal: no compiled-in length here (GPU modules' fwd takes it)
    ("b:300,0", 256, 256, "plan"),
    ("t", 256, 512, "plan"),
    ("0", 256, 100, "plan"),  # Sk not a multiple of 32
]


@pytest.mark.parametrize("mask,sq,sk,path", DENSE_CASES, ids=[f"{m}-{a}x{b}" for m, a, b, _ in DENSE_CASES])
@pytest.mark.parametrize("layout,group", [("bhsd", 1), ("bshd", 2)])
def test_dense_entry_points(fused_module, mask, sq, sk, path, layout, group):
    q, k, v = make_qkv(seed_of("dense", mask, sq, sk, layout, group), B=2, Hq=2 * group, Hk=2, Sq=sq, Sk=sk, Dq=64,
                       layout=layout)
    mod = fused_module("f32", layout, group, 64)
    p, (out, lse) = _run(mod, q, k, v, mask, layout=layout)
    assert route(mod, p).path == path
    ref_out, ref_lse = attention_ref(q, k, v, mask=mask, layout=layout)
    assert_close(out, ref_out, torch.float32, what=f"dense out {mask} {sq}x{sk} {layout}")
    assert_close(lse, ref_lse, torch.float32, kind="lse", what=f"dense lse {mask} {sq}x{sk} {layout}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mask", ["0", "b"])
def test_dense_entry_points_half(fused_module, dtype, mask):
    q, k, v = make_qkv(seed_of("dense-half", str(dtype), mask), B=1, Hq=2, Hk=1, Sq=256, Sk=256, Dq=64, Dv=32,
                       dtype=dtype)
    mod = fused_module({torch.float16: "f16", torch.bfloat16: "bf16"}[dtype], "bhsd", 2, 64, 32)
    p, (out, lse) = _run(mod, q, k, v, mask)
    assert route(mod, p).path == ("dense" if mask == "0" else "plan")
    ref_out, ref_lse = attention_ref(q, k, v, mask=mask)
    assert out.dtype == dtype
    assert_close(out, ref_out, dtype, what=f"dense {dtype} {mask}")
    assert_close(lse, ref_lse, dtype, kind="lse", what=f"dense lse {dtype} {mask}")


@pytest.mark.parametrize("mask,sq", [("b", 256), ("t:3,40", 77)], ids=["dense-path", "plan-path"])
def test_device_tensors_stay_on_device(fused_module, mask, sq):
    """DeviceTensor inputs give DeviceTensor results on both paths; bf16 stays bf16."""
    q, k, v = make_qkv(seed_of("devt", mask), B=1, Hq=2, Hk=1, Sq=sq, Sk=sq, Dq=64, dtype=torch.bfloat16)
    mod = fused_module("bf16", "bhsd", 2, 64)
    qd, kd, vd = (fmha_iree.to_device(x, "local-task") for x in (q, k, v))
    assert isinstance(qd, DeviceTensor) and qd.dtype == "bf16" and qd.shape == tuple(q.shape)
    _, (out, lse) = _run(mod, qd, kd, vd, mask)
    assert isinstance(out, DeviceTensor) and isinstance(lse, DeviceTensor)
    ref_out, ref_lse = attention_ref(q, k, v, mask=mask)
    assert_close(out.to_torch(), ref_out, torch.bfloat16, what=f"device out {mask}")
    assert_close(lse.to_torch(), ref_lse, torch.bfloat16, kind="lse", what=f"device lse {mask}")


# Lengths compiled into the module (`--seqlens`): without LSE IREE's fused attention op, unmasked
# (`dense_o_s<S>`) or masked (`causal_o_s<S>`); causal with the LSE, windows and other lengths keep
# the dynamic entry points (here, built without fwd, the plan).
SEQLEN_CASES = [
    # (mask, S, return_lse, entry point)
    ("b", 256, True, None),
    ("t", 512, True, None),
    ("b", 512, False, "causal_o_s512"),  # without LSE: one masked fused op
    ("0", 256, False, "dense_o_s256"),
    ("0", 512, True, "dense"),  # the LSE needs the online_attention form
    ("b", 768, True, None),  # not compiled in: the plan (GPU modules' fwd)
    ("0", 768, False, "dense"),
    ("b:100,0", 512, True, None),  # sliding windows: the plan (GPU modules' fwd)
]


@pytest.mark.parametrize("mask,s,with_lse,entry", SEQLEN_CASES, ids=[f"{m}-{s}-{'lse' if w else 'out'}" for m, s, w, _ in SEQLEN_CASES])
@pytest.mark.parametrize("layout,group,dtype", [("bhsd", 2, torch.float32), ("bshd", 1, torch.float16)],
                         ids=["bhsd-g2-f32", "bshd-g1-f16"])
def test_compiled_in_lengths(fused_module, mask, s, with_lse, entry, layout, group, dtype):
    mod = fused_module({torch.float32: "f32", torch.float16: "f16"}[dtype], layout, group, 64, seqlens=(256, 512))
    assert mod.caps.dense.seqlens == (256, 512)
    q, k, v = make_qkv(seed_of("seqlens", mask, s, layout), B=2, Hq=2 * group, Hk=2, Sq=s, Sk=s, Dq=64,
                       layout=layout, dtype=dtype)
    p = check_batch(q, k, v, mask=mask, scale=None, layout=layout, cu_seqlen_q=None, cu_seqlen_k=None)
    assert route(mod, p, with_lse).entry == entry
    res = run_batch(mod, p, with_lse)
    ref_out, ref_lse = attention_ref(q, k, v, mask=mask, layout=layout)
    out = res[0] if with_lse else res
    assert_close(out, ref_out, dtype, what=f"{entry} out")
    if with_lse:
        assert_close(res[1], ref_lse, dtype, kind="lse", what=f"{entry} lse")


def test_async_results_chain_on_device(fused_module):
    """A DeviceTensor result of an asynchronous call feeds the next call before it is ready (the
    runtime waits for its fence first: IREE's local driver refuses an uncommitted buffer), and the
    numbers are those of two host-synchronized calls."""
    mod = fused_module("f32", "bhsd", 2, 64, seqlens=(256, 512))
    q, k, v = make_qkv(seed_of("chain"), B=1, Hq=4, Hk=2, Sq=256, Sk=256, Dq=64)
    qd, kd, vd = (fmha_iree.to_device(x, "local-task") for x in (q, k, v))
    p1 = check_batch(qd, kd, vd, mask="b", scale=None, layout="bhsd", cu_seqlen_q=None, cu_seqlen_k=None)
    out1 = run_batch(mod, p1, False)
    assert isinstance(out1, DeviceTensor) and out1.ready is not None
    p2 = check_batch(out1, kd, vd, mask="0", scale=None, layout="bhsd", cu_seqlen_q=None, cu_seqlen_k=None)
    out2 = run_batch(mod, p2, False)
    first = out1.to_torch()
    ref1, _ = attention_ref(q, k, v, mask="b")
    assert_close(first, ref1, torch.float32, what="first call")
    ref2, _ = attention_ref(first, k, v, mask="0")
    assert_close(out2.to_torch(), ref2, torch.float32, what="chained call")


def test_workspace_slots_serve_calls_in_flight(fused_module):
    """One-call entry points get their intermediates in the module's workspace slots: more
    back-to-back asynchronous calls than slots (each with its own inputs, results left on the
    device) each give their own numbers, and the slots are sized by IREE's transients query."""
    mod = fused_module("f32", "bhsd", 2, 64, seqlens=(256, 512))
    n = mod.module.WORKSPACE_SLOTS + 4
    qkv = [make_qkv(seed_of("slots", i), B=1, Hq=4, Hk=2, Sq=512, Sk=512, Dq=64) for i in range(n)]
    outs = []
    for q, k, v in qkv:
        dev = [fmha_iree.to_device(x, "local-task") for x in (q, k, v)]
        p = check_batch(*dev, mask="0", scale=None, layout="bhsd", cu_seqlen_q=None, cu_seqlen_k=None)
        outs.append(run_batch(mod, p))
    assert route(mod, p).entry == "dense"
    mod = mod.module
    sizes = [b for (fn, *_), b in mod.workspace_sizes.items() if fn == "dense"]
    assert sizes and sizes[0] > 0 and mod.workspace_bytes >= sizes[0]
    for (q, k, v), (out, lse) in zip(qkv, outs):
        ref_out, ref_lse = attention_ref(q, k, v, mask="0")
        assert_close(out.to_torch(), ref_out, torch.float32, what="dense out in flight")
        assert_close(lse.to_torch(), ref_lse, torch.float32, kind="lse", what="dense lse in flight")
    mod.release_workspace()
    assert mod.workspace_bytes == 0


def _template_on_host(text: str, S: int, A: int, layout: str, q, k, v, *extra):
    """Compile one rendered template function (the module's only one) for llvm-cpu and call it on
    q/k/v split along the sequence axis as the ABI wants it, (S/A, A), the scale and ``extra``;
    returns its results."""
    import iree.compiler.tools as ict
    import iree.runtime as rt

    name = text.split("util.func public @", 1)[1].split("(", 1)[0]
    vmfb = ict.compile_str("module @m {\n" + text + "\n}\n",
                           extra_args=Target.from_name("host").compile_flags() + ["--iree-input-type=auto"])
    tile = (lambda x: x.reshape(x.shape[0], x.shape[1], S // A, A, x.shape[-1])) if layout == "bhsd" else (
        lambda x: x.reshape(x.shape[0], S // A, A, x.shape[2], x.shape[-1]))
    mod = rt.load_vm_flatbuffer(vmfb, driver="local-task")
    res = getattr(mod, name)(*(tile(x).numpy() for x in (q, k, v)), np.array([q.shape[-1] ** -0.5], np.float32), *extra)
    return [torch.from_numpy(np.asarray(r.to_host())) for r in (res if isinstance(res, tuple) else (res,))]


@pytest.mark.parametrize("layout,group,dtype", [("bhsd", 2, torch.float32), ("bshd", 1, torch.float16)],
                         ids=["bhsd-g2-f32", "bshd-g1-f16"])
def test_dense_out_transposed_v(layout, group, dtype):
    """The out-only template with V copied to [BH, Dv, S] first (the CUDA tiles' ``transpose_v``),
    built for llvm-cpu: same numbers as the float64 reference."""
    from fmha_iree.codegen.mlir_templates import TRANSPOSE_V_MIN_SEQLEN, render_dense_out

    S, A, D, B, Hk = TRANSPOSE_V_MIN_SEQLEN, 64, 64, 1, 2
    dt = {torch.float32: "f32", torch.float16: "f16"}[dtype]
    low = {"backend": "cpu", "workgroup_m": 64, "reduction_k2": 32, "workgroup_n": D, "transpose_v": True}
    text = render_dense_out(func_name="f", dtype=dt, layout=layout, group=group, dq=D, dv=D, align=A,
                            lowering=low, seqlen=S)
    assert "-> (d0, d4, d3)>" in text  # the op reads V transposed
    short = render_dense_out(func_name="f", dtype=dt, layout=layout, group=group, dq=D, dv=D, align=A,
                             lowering=low, seqlen=S // 2)
    assert "-> (d0, d4, d3)>" not in short  # below TRANSPOSE_V_MIN_SEQLEN V is read in place
    q, k, v = make_qkv(seed_of("transpose_v", layout, group), B=B, Hq=Hk * group, Hk=Hk, Sq=S, Sk=S, Dq=D,
                       layout=layout, dtype=dtype)
    (out,) = _template_on_host(text, S, A, layout, q, k, v)
    ref_out, _ = attention_ref(q, k, v, mask="0", layout=layout)
    assert_close(out.reshape(ref_out.shape), ref_out, dtype, what="dense_out transpose_v")
