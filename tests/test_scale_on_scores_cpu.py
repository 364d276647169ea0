"""The attention ops with the softmax scale on the f32 scores instead of on Q (a lowering's
``scale_on_scores``, ``kernels.attention``; ROCm bf16 modules take it, ``source.scale_on_scores``),
checked for numbers on the CPU: the GPU modules' formulation built for llvm-cpu in bf16 with the
decision forced on, driven through the batch-mode routing, against the float64 reference. Covered:
every path of ``fwd`` that writes the op (the main tier's open and masked ops, the banded window,
the short tier with split-KV), tails, Sq != Sk, GQA, rows that see no key, LSE; and the one-call
entry points of the templates (``dense``, and at a compiled-in length ``dense_o_s<S>``,
``causal_o_s<S>``)."""

import pytest
import torch

import fmha_iree.codegen.source as source
from fmha_iree.paths.base import Refused
from fmha_iree.paths.tiles import TILES
from fmha_iree.problem.spec import KernelSpec, check_batch
from fmha_iree.problem.targets import Target
from common import RAGGED_TILES, _shared_vmfb, bind, gpu_formulation, route, run_batch

from reference import assert_close, attention_ref, make_qkv, seed_of


@pytest.fixture(scope="module")
def scaled_module():
    """A bf16 ``bshd`` G = 2 module whose ``fwd`` ops multiply the scores by the scale."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(source, "scale_on_scores", lambda spec: True)
        spec = KernelSpec("bf16", "bshd", 2, 64, 64, RAGGED_TILES, Target.from_name("host"))
        text = source.source_mlir(spec, fused_step=True)
        assert "%scaled = arith.mulf %score" in text, "the scores' scale is not in the rendered ops"
        return gpu_formulation("bf16", "bshd", 2, 64)


@pytest.fixture(autouse=True)
def no_tiles(monkeypatch):
    monkeypatch.setattr(type(TILES), "plan", lambda self, prob, caps: Refused(("off in this test",)))


@pytest.mark.parametrize("sq,sk,mask", [(77, 130, "b"), (130, 77, "t"), (200, 200, "0"), (1, 2000, "b"),
                                        (700, 700, "b"), (1000, 1024, "b:256,0"), (150, 60, "b"), (300, 900, "t:40,30")],
                         ids=["77x130-b", "130x77-t", "200-open", "decode", "groups", "band", "rows-see-none", "window"])
def test_scores_scaled(scaled_module, sq, sk, mask):
    q, k, v = make_qkv(seed_of("scale-scores", sq, sk, mask), B=2, Hq=4, Hk=2, Sq=sq, Sk=sk, Dq=64,
                       dtype=torch.bfloat16, layout="bshd")
    scale = 0.3 if mask == "0" else None  # a scale of the caller's besides the default 1/sqrt(Dq)
    p = check_batch(q, k, v, mask=mask, scale=scale, layout="bshd", cu_seqlen_q=None, cu_seqlen_k=None)
    assert route(scaled_module, p).path == "fwd"
    out, lse = run_batch(scaled_module, p)
    ref_out, ref_lse = attention_ref(q, k, v, mask=mask, layout="bshd", scale=scale)
    assert_close(out, ref_out, torch.bfloat16, what=f"out {mask} {sq}x{sk}")
    assert_close(lse, ref_lse, torch.bfloat16, kind="lse", what=f"lse {mask} {sq}x{sk}")


# The compiled-in length of ``scaled_entries``.
S = 256


@pytest.fixture(scope="module")
def scaled_entries():
    """A bf16 ``bshd`` G = 2 module with S compiled in whose one-call entry points multiply the
    scores by the scale (no ``fwd``: these tests are about the other entries)."""
    from fmha_iree.toolchain.compile import ASYNC_FLAGS, compile_flags

    spec = KernelSpec("bf16", "bshd", 2, 64, 64, RAGGED_TILES, Target.from_name("host"), (S,))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(source, "scale_on_scores", lambda spec: True)
        text = source.source_mlir(spec, fused_step=True, with_fwd=False)
    for name in ("dense", f"dense_o_s{S}", f"causal_o_s{S}"):
        func = text.split(f"util.func public @{name}(", 1)[1].split("\nutil.func", 1)[0]
        ops = func.count("^bb0(%score: f32):")
        assert ops and func.count("%scaled = arith.mulf %score, %scale_l : f32") == ops, f"{name}: unscaled scores"
        assert "arith.truncf %scale_f32" not in func, f"{name}: Q scaled in bf16"
    vmfb = _shared_vmfb(text, compile_flags(spec) + ASYNC_FLAGS)
    return bind(vmfb, spec)


@pytest.mark.parametrize("mask,s,with_lse,entry", [
    ("0", S, True, "dense"), ("0", S, False, f"dense_o_s{S}"), ("b", S, False, f"causal_o_s{S}")],
    ids=["dense", "dense_o", "causal_o"])
def test_entries_scores_scaled(scaled_entries, mask, s, with_lse, entry):
    q, k, v = make_qkv(seed_of("scale-scores-entries", mask, s), B=2, Hq=4, Hk=2, Sq=s, Sk=s, Dq=64,
                       dtype=torch.bfloat16, layout="bshd")
    scale = 0.3 if entry == "dense" else None  # besides the default 1/sqrt(Dq)
    p = check_batch(q, k, v, mask=mask, scale=scale, layout="bshd", cu_seqlen_q=None, cu_seqlen_k=None)
    assert route(scaled_entries, p, with_lse).entry == entry
    res = run_batch(scaled_entries, p, with_lse)
    ref_out, ref_lse = attention_ref(q, k, v, mask=mask, layout="bshd", scale=scale)
    assert_close(res[0] if with_lse else res, ref_out, torch.bfloat16, what=f"{entry} out")
    if with_lse:
        assert_close(res[1], ref_lse, torch.bfloat16, kind="lse", what=f"{entry} lse")
