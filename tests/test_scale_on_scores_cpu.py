"""The attention ops with the softmax scale on the f32 scores instead of on Q (a lowering's
``scale_on_scores``, ``kernels.attention``; ROCm bf16 modules take it, ``source.scale_on_scores``),
checked for numbers on the CPU: the GPU modules' formulation built for llvm-cpu in bf16 with the
decision forced on, driven through the batch-mode routing, against the float64 reference. Covered:
every path of ``fwd`` that writes the op (the main tier's open and masked ops, the banded window,
the short tier with split-KV), tails, Sq != Sk, GQA, rows that see no key, LSE."""

import pytest
import torch

import fmha_iree.source as source
from fmha_iree import dispatch
from fmha_iree.dispatch import run_batch, uses_fwd
from fmha_iree.spec import check_batch
from common import RAGGED_TILES, gpu_formulation

from reference import assert_close, attention_ref, make_qkv, seed_of


@pytest.fixture(scope="module")
def scaled_module():
    """A bf16 ``bshd`` G = 2 module whose ``fwd`` ops multiply the scores by the scale."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(source, "scale_on_scores", lambda spec: True)
        from fmha_iree.spec import KernelSpec
        from fmha_iree.targets import Target

        spec = KernelSpec("bf16", "bshd", 2, 64, 64, RAGGED_TILES, Target.from_name("host"))
        text = source.source_mlir(spec, fused_step=True)
        assert "%scaled = arith.mulf %score" in text, "the scores' scale is not in the rendered ops"
        return gpu_formulation("bf16", "bshd", 2, 64)


@pytest.fixture(autouse=True)
def no_tiles(monkeypatch):
    monkeypatch.setattr(dispatch, "_takes_tiles", lambda *a: False)


@pytest.mark.parametrize("sq,sk,mask", [(77, 130, "b"), (130, 77, "t"), (200, 200, "0"), (1, 2000, "b"),
                                        (700, 700, "b"), (1000, 1024, "b:256,0"), (150, 60, "b"), (300, 900, "t:40,30")],
                         ids=["77x130-b", "130x77-t", "200-open", "decode", "groups", "band", "rows-see-none", "window"])
def test_scores_scaled(scaled_module, sq, sk, mask):
    q, k, v = make_qkv(seed_of("scale-scores", sq, sk, mask), B=2, Hq=4, Hk=2, Sq=sq, Sk=sk, Dq=64,
                       dtype=torch.bfloat16, layout="bshd")
    scale = 0.3 if mask == "0" else None  # a scale of the caller's besides the default 1/sqrt(Dq)
    p = check_batch(q, k, v, mask=mask, scale=scale, layout="bshd", cu_seqlen_q=None, cu_seqlen_k=None)
    assert uses_fwd(p, scaled_module)
    out, lse = run_batch(p, True, RAGGED_TILES, lambda: scaled_module, "gpu")
    ref_out, ref_lse = attention_ref(q, k, v, mask=mask, layout="bshd", scale=scale)
    assert_close(out, ref_out, torch.bfloat16, what=f"out {mask} {sq}x{sk}")
    assert_close(lse, ref_lse, torch.bfloat16, kind="lse", what=f"lse {mask} {sq}x{sk}")
