"""fmha_iree attention inside a whole exported model (``integrations.model_export``): a torch model
calling ``torch.ops.fmha_iree.fmha_fwd`` exported with iree-turbine, compiled as one module and run
through ``iree.runtime`` alone, against the float64 reference; refusals before iree-compile; the
turbine shims still needed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from reference import assert_close, attention_ref

import iree.runtime as rt
from fmha_iree.integrations.model_export import compile_model, export_model, model_compile_flags
from fmha_iree.integrations.torch_ops import attention

MASKS = ["0", "t", "b", "t:5,3", "b:4,0", "xt:7", "xb:9"]


class Masks(torch.nn.Module):
    """Every CK mask kind on one q, k, v (bshd, GQA): each call site's out and LSE; the first call
    also with its own scale."""

    def forward(self, q, k, v):
        res = []
        for m in MASKS:
            res += list(attention(q, k, v, mask=m, layout="bshd", return_lse=True))
        res.append(attention(q, k, v, mask="b", scale=0.3, layout="bshd"))
        return tuple(res)


class Cast(torch.nn.Module):
    """f16 in bhsd and bf16 in bshd, cast inside the model (host arrays stay f32)."""

    def forward(self, q, k, v):
        bhsd = [x.transpose(1, 2).to(torch.float16) for x in (q, k, v)]
        a = attention(*bhsd, mask="b", layout="bhsd").transpose(1, 2).float()
        b = attention(*(x.to(torch.bfloat16) for x in (q, k, v)), mask="t:6,0", layout="bshd").float()
        return a, b


def _run(vmfb: bytes, *arrays):
    """The module's ``main`` run through ``iree.runtime`` alone: its results as numpy arrays."""
    ctx = rt.SystemContext(config=rt.Config("local-task"))
    ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, vmfb))
    res = ctx.modules.module["main"](*arrays)
    return [np.asarray(r.to_host()) for r in (res if isinstance(res, (list, tuple)) else [res])]


def _compiled(model, shapes, tmp_path, dyn=True):
    q, k, v = (torch.zeros(s) for s in shapes)
    dynamic = None
    if dyn:
        s, t = torch.export.Dim("S", max=4096), torch.export.Dim("T", max=4096)
        dynamic = {"q": {1: s}, "k": {1: t}, "v": {1: t}}
    mlir = export_model(model, (q, k, v), target="host", dynamic_shapes=dynamic)
    out = tmp_path / "model.vmfb"
    manifest = compile_model(mlir, target="host", output=out)
    assert manifest["functions"] == ["main"] and (tmp_path / "model.json").exists()
    return out.read_bytes()


def _qkv(seed, B, Sq, Sk, Hq, Hk, D, Dv):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Sq, Hq, D, generator=g), torch.randn(B, Sk, Hk, D, generator=g),
            torch.randn(B, Sk, Hk, Dv, generator=g))


def test_every_mask_gqa_lse_and_lengths(tmp_path):
    """One module: seven masks, GQA 4:2, Dv != Dq, runtime Sq != Sk (decode, chunked prefill,
    Sq > Sk), each call's out and LSE against float64."""
    vmfb = _compiled(Masks(), [(2, 8, 4, 64), (2, 8, 2, 64), (2, 8, 2, 32)], tmp_path)
    for i, (sq, sk) in enumerate([(37, 37), (20, 45), (1, 70), (64, 33)]):
        q, k, v = _qkv(i, 2, sq, sk, 4, 2, 64, 32)
        res = _run(vmfb, q.numpy(), k.numpy(), v.numpy())
        for j, m in enumerate(MASKS):
            out, lse = attention_ref(q, k, v, mask=m, layout="bshd")
            assert_close(res[2 * j], out, torch.float32, what=f"{m} {sq}x{sk}")
            assert_close(res[2 * j + 1], lse, torch.float32, kind="lse", what=f"{m} {sq}x{sk}")
        out, _ = attention_ref(q, k, v, mask="b", scale=0.3, layout="bshd")
        assert_close(res[-1], out, torch.float32, what=f"scale {sq}x{sk}")


def test_half_types_and_bhsd(tmp_path):
    """f16 (bhsd) and bf16 (bshd) kernels in one model, MQA 4:1."""
    vmfb = _compiled(Cast(), [(1, 8, 4, 64), (1, 8, 1, 64), (1, 8, 1, 64)], tmp_path)
    q, k, v = _qkv(7, 1, 50, 90, 4, 1, 64, 64)
    a, b = _run(vmfb, q.numpy(), k.numpy(), v.numpy())
    for res, dtype, mask in ((a, torch.float16, "b"), (b, torch.bfloat16, "t:6,0")):
        rq, rk, rv = (x.to(dtype) for x in (q, k, v))
        out, _ = attention_ref(rq, rk, rv, mask=mask, layout="bshd")
        assert_close(res, out, dtype, what=str(dtype))


def test_static_unit_batch_with_groups(tmp_path):
    """Static B * Hk = 1 with G = 4 at the call site (every size static): the kernel is still
    compiled with its sizes dynamic and the result is right (IREE 3.13 miscompiled the inlined
    kernel when the static sizes reached it: docs/model-export.md)."""
    vmfb = _compiled(Masks(), [(1, 33, 4, 64), (1, 70, 1, 64), (1, 70, 1, 32)], tmp_path, dyn=False)
    q, k, v = _qkv(3, 1, 33, 70, 4, 1, 64, 32)
    res = _run(vmfb, q.numpy(), k.numpy(), v.numpy())
    for j, m in enumerate(MASKS):
        out, _ = attention_ref(q, k, v, mask=m, layout="bshd")
        assert_close(res[2 * j], out, torch.float32, what=m)


def test_eager_model_runs_through_fmha_iree():
    """The same model called eagerly runs fmha_iree's own modules, same semantics."""
    q, k, v = _qkv(5, 1, 9, 12, 4, 2, 64, 32)
    res = Masks()(q, k, v)
    out, lse = attention_ref(q, k, v, mask="b", layout="bshd")
    assert_close(res[4], out, torch.float32)
    assert_close(res[5], lse, torch.float32, kind="lse")


class _Sdpa(torch.nn.Module):
    def forward(self, q, k, v):
        import fmha_iree

        return fmha_iree.sdpa(q, k, v, is_causal=True, enable_gqa=True)


def test_sdpa_model_exports_unchanged(tmp_path):
    """A model written against the SDPA drop-in exports as it is (bhsd)."""
    q, k, v = (torch.zeros(s) for s in [(1, 4, 8, 64), (1, 2, 8, 64), (1, 2, 8, 64)])
    s = torch.export.Dim("S", max=4096)
    mlir = export_model(_Sdpa(), (q, k, v), target="host", dynamic_shapes={"q": {2: s}, "k": {2: s}, "v": {2: s}})
    compile_model(mlir, target="host", output=tmp_path / "m.vmfb")
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, h, 21, 64, generator=g) for h in (4, 2, 2))
    (res,) = _run((tmp_path / "m.vmfb").read_bytes(), q.numpy(), k.numpy(), v.numpy())
    out, _ = attention_ref(q, k, v, mask="t")
    assert_close(res, out, torch.float32)


@pytest.mark.parametrize("target, dtype, fragment", [("gfx9999", torch.float16, "target"),
                                                     ("sm_80", torch.float32, "dtype")])
def test_refusals_before_iree_compile(target, dtype, fragment):
    """An unknown target, or a dtype the target's kernels do not take, is a ValueError naming it,
    raised at export (iree-compile never runs)."""
    q, k, v = (torch.zeros(s, dtype=dtype) for s in [(1, 8, 4, 64), (1, 8, 2, 64), (1, 8, 2, 64)])

    class One(torch.nn.Module):
        def forward(self, q, k, v):
            return attention(q, k, v, mask="b", layout="bshd")

    with pytest.raises(ValueError, match=fragment):
        export_model(One(), (q, k, v), target=target)
    with pytest.raises(ValueError, match="mask"):
        attention(q, k, v, mask="zz")
    with pytest.raises(TypeError, match="target"):
        model_compile_flags(7)


def test_bias_is_refused_at_export():
    """An elementwise bias is not taken inside exported models yet: a ValueError naming it at
    export (the eager call takes it)."""
    q, k, v = (torch.zeros(s) for s in [(1, 4, 8, 64), (1, 2, 8, 64), (1, 2, 8, 64)])

    class Biased(torch.nn.Module):
        def forward(self, q, k, v, b):
            return attention(q, k, v, mask="b", bias=b)

    with pytest.raises(ValueError, match="bias: an elementwise bias is not taken inside exported models"):
        export_model(Biased(), (q, k, v, torch.zeros(1, 4, 8, 8)), target="host")


def test_turbine_shims_still_needed():
    """Fails once the pinned compiler bindings have ``Type.isinstance`` again or turbine stops
    calling it: then delete ``integrations/turbine_shims.py``'s shim."""
    import inspect

    import iree.turbine.dynamo.type_conversion as tc

    code = "from iree.compiler import ir; print(hasattr(ir.IntegerType, 'isinstance'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False", "the compiler's bindings have Type.isinstance again: the shim can go"
    assert "IntegerType.isinstance(" in inspect.getsource(tc), "turbine no longer calls Type.isinstance"


def test_llama_example_generates_the_eager_tokens(tmp_path):
    """README's example: a small Llama-style decoder with a paged cache exported as one module
    (prefill, decode), greedy generation through iree.runtime alone gives the tokens and logits of
    the same model in torch eager with torch's SDPA."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import llama_export as ex

    cfg = ex.Config(layers=2, pages=8)
    model = ex.Decoder(cfg)
    out = tmp_path / "llama.vmfb"
    manifest = compile_model(ex.export(model, "host"), target="host", output=out)
    assert manifest["functions"] == ["decode", "prefill"]
    prompt = [1, 17, 42, 7, 99, 3, 250, 8, 64, 5, 11]
    table = np.random.default_rng(0).permutation(cfg.pages).astype(np.int64)
    ours, lo = ex.generate_iree(out.read_bytes(), prompt, 12, table, model.new_cache().numpy())
    ref, lr = ex.generate_eager(ex.Decoder(cfg, attention="sdpa"), prompt, 12, torch.from_numpy(table))
    assert ours == ref
    np.testing.assert_allclose(lo, lr, atol=1e-4, rtol=1e-4)


USER_MLIR = """module @user {{
  {decl}
  util.func public @main(%q: {tq}, %k: {tq}, %v: {tq}) -> {tq} {{
    %scale = arith.constant 0.125 : f32
    %c1 = arith.constant 1 : index
    %sq = tensor.dim %q, %c1 : {tq}
    %sk = tensor.dim %k, %c1 : {tq}
    %d = arith.subi %sq, %sk : index
    %y0 = arith.addi %sq, %c1 : index
    %y = arith.index_cast %y0 : index to i64
    %x = arith.constant 1 : i64
    %x1 = arith.index_cast %d : index to i64
    %x2 = arith.subi %x, %x1 : i64
    %r:2 = util.call @fmha_iree.attention(%q, %k, %v, %scale, %y, %x2) : {sig}
    util.return %r#0 : {tq}
  }}
}}
"""


def test_link_module_for_iree_link(tmp_path):
    """Without turbine: ``fmha-iree link-module`` writes the attention function, a hand-written
    module declares and calls it with CK's (y, x) of mask ``b`` (y = Sq + 1 clipped, x = 1 + Sk - Sq),
    ``iree-link`` links the two, iree-compile builds the result, and it matches float64."""
    import iree.compiler.tools as ict
    from iree.compiler.tools.binaries import find_tool

    attn = tmp_path / "attn.mlir"
    r = subprocess.run([sys.executable, "-m", "fmha_iree.cli", "link-module", "--target", "host", "--dtype", "f32",
                        "--hdim", "64", "--heads", "4:2", "--layout", "bshd", "-o", str(attn)],
                       capture_output=True, text=True, check=True)
    decl = r.stdout.splitlines()[1].strip()
    tq = "tensor<?x?x?x64xf32>"
    sig = f"({tq}, {tq}, {tq}, f32, i64, i64) -> ({tq}, tensor<?x?x?xf32>)"
    assert decl == f"util.func private @fmha_iree.attention{sig}"
    (tmp_path / "user.mlir").write_text(USER_MLIR.format(decl=decl, tq=tq, sig=sig))
    subprocess.run([find_tool("iree-link"), f"--link-module={attn}", str(tmp_path / "user.mlir"), "-o",
                    str(tmp_path / "linked.mlir")], check=True)
    vmfb = ict.compile_file(str(tmp_path / "linked.mlir"), extra_args=model_compile_flags("host"))
    ctx = rt.SystemContext(config=rt.Config("local-task"))
    ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, vmfb))
    q, k, v = _qkv(9, 2, 30, 50, 4, 2, 64, 64)
    out = np.asarray(ctx.modules.user["main"](q.numpy(), k.numpy(), v.numpy()).to_host())
    ref, _ = attention_ref(q, k, v, mask="b", scale=0.125, layout="bshd")
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("target, instr", [("gfx942", "mfma_count"), ("gfx1100", "wmma_count")])
def test_example_compiles_for_gfx(tmp_path, target, instr):
    """The example decoder (f16, GQA 4:1, head dim 128) exported for gfx targets compiles as CI's
    gfx matrix requires: no spill in any kernel, matrix instructions in the attention kernels."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import llama_export as ex

    cfg = ex.Config(layers=2, pages=8, dim=512, heads=4, kv_heads=1, head_dim=128, dtype=torch.float16)
    manifest = compile_model(ex.export(ex.Decoder(cfg), target), target=target, output=tmp_path / "m.vmfb")
    isa = manifest["isa"]
    attention = [k for k in isa if k["kernel"].startswith("fmha_iree_")]
    assert attention and len(isa) > len(attention)
    assert sum(k["vgpr_spill_count"] + k["sgpr_spill_count"] for k in isa) == 0
    assert sum(k[instr] for k in attention) > 0


class _Decode(torch.nn.Module):
    def forward(self, q, k, v):  # bhsd f16, a static one-row query: the CPU's short-tile kernel
        x = [t.transpose(1, 2).to(torch.float16) for t in (q, k, v)]
        return attention(*x, mask="b", layout="bhsd").transpose(1, 2).float()


def test_decode_call_sites_take_short_tiles(tmp_path):
    """A call site whose queries are statically short (decode: Sq * G <= 8) gets the CPU kernel of
    8-row tiles (its name says so), with any key count at run time; f16, bhsd, MQA 4:1, B2."""
    t = torch.export.Dim("T", max=8192)
    q, k, v = (torch.zeros(s) for s in [(2, 1, 4, 64), (2, 8, 1, 64), (2, 8, 1, 64)])
    mlir = export_model(_Decode(), (q, k, v), target="host", dynamic_shapes={"q": {}, "k": {1: t}, "v": {1: t}})
    assert "_short(" in mlir
    compile_model(mlir, target="host", output=tmp_path / "d.vmfb")
    for i, sk in enumerate((1, 90, 700)):
        q, k, v = _qkv(20 + i, 2, 1, sk, 4, 1, 64, 64)
        (res,) = _run((tmp_path / "d.vmfb").read_bytes(), q.numpy(), k.numpy(), v.numpy())
        out, _ = attention_ref(*(x.to(torch.float16) for x in (q, k, v)), mask="b", layout="bshd")
        assert_close(res, out, torch.float16, what=f"Sk {sk}")


class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("kind, window", [("Llama", None), ("Mistral", 5)])
def test_transformers_model_exports_unchanged(tmp_path, kind, window):
    """A tiny transformers model built with attn_implementation="fmha_iree" (Mistral with a
    sliding window of 5) exports unchanged: its logits from the compiled module equal the same
    model's in transformers' "eager" attention at lengths other than the export's; a padding
    mask is refused at export, naming attention_mask."""
    transformers = pytest.importorskip("transformers")
    from fmha_iree.integrations.hf import register_transformers

    extra = {"sliding_window": window} if window else {}
    cfg = getattr(transformers, f"{kind}Config")(vocab_size=128, hidden_size=64, intermediate_size=128,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                 max_position_embeddings=256, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, f"{kind}ForCausalLM")(cfg).eval()
    model.config._attn_implementation = register_transformers()
    ids = torch.randint(0, 128, (1, 12))
    s = torch.export.Dim("S", max=255)
    mlir = export_model(_Logits(model), (ids,), target="host", dynamic_shapes={"ids": {1: s}})
    compile_model(mlir, target="host", output=tmp_path / "hf.vmfb")
    for n in (9, 40):
        ids = torch.randint(0, 128, (1, n))
        (got,) = _run((tmp_path / "hf.vmfb").read_bytes(), ids.numpy())
        model.config._attn_implementation = "eager"
        with torch.no_grad():
            ref = model(input_ids=ids, use_cache=False).logits.numpy()
        model.config._attn_implementation = "fmha_iree"
        np.testing.assert_allclose(got, ref, atol=2e-5, rtol=0)

    class Padded(torch.nn.Module):
        def forward(self, ids, mask):
            return model(input_ids=ids, attention_mask=mask, use_cache=False).logits

    with pytest.raises(ValueError, match="attention_mask"):
        export_model(Padded(), (ids, torch.ones_like(ids)), target="host")
