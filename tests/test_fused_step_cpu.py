"""The GPU formulation of ``step`` (the fused ``online_attention`` template) checked for numbers on
the CPU, where CI runs: the module is built exactly as for gfx/CUDA targets but for llvm-cpu, then
driven by the same plan as any module and compared with the float64 reference."""

import numpy as np
import pytest
import torch

import fmha_iree
from fmha_iree.api import run_batch
from fmha_iree.compile import compile_flags, source_mlir
from fmha_iree.runtime import FmhaModule
from fmha_iree.spec import KernelSpec, check_batch
from fmha_iree.targets import Target

from reference import assert_close, attention_ref, make_qkv, seed_of

# Small units so a few hundred rows cross several tiles and key chunks.
TILES = fmha_iree.TileConfig(m0=32, n0=32, k0=16, n1=64, k1=16, kv_chunk=64)


@pytest.fixture(scope="module")
def fused_module():
    import iree.compiler.tools as ict

    mods = {}

    def get(dtype, layout, group, d):
        key = (dtype, layout, group, d)
        if key not in mods:
            spec = KernelSpec(dtype, layout, group, d, d, TILES, Target.from_name("host"))
            vmfb = ict.compile_str(source_mlir(spec, fused_step=True), extra_args=compile_flags(spec))
            mods[key] = FmhaModule(vmfb, "local-task", spec.module_name)
        return mods[key]

    return get


@pytest.mark.parametrize("mask", ["0", "b", "t", "b:20,0", "t:3,40", "xb:9"])
@pytest.mark.parametrize("sq,sk", [(77, 130), (130, 77), (200, 200)], ids=["77x130", "130x77", "200x200"])
def test_fused_step_matches_reference(fused_module, mask, sq, sk):
    q, k, v = make_qkv(seed_of("fused", mask, sq, sk), B=2, Hq=4, Hk=2, Sq=sq, Sk=sk, Dq=64)
    p = check_batch(q, k, v, mask=mask, scale=None, layout="bhsd", cu_seqlen_q=None, cu_seqlen_k=None)
    mod = fused_module("f32", "bhsd", 2, 64)
    out, lse = run_batch(p, True, TILES, lambda: mod, "gpu")
    ref_out, ref_lse = attention_ref(q, k, v, mask=mask)
    assert_close(out, ref_out, torch.float32, what=f"fused out mask={mask}")
    assert_close(lse, ref_lse, torch.float32, kind="lse", what=f"fused lse mask={mask}")


def test_fused_step_padding_and_f16_bshd(fused_module):
    q, k, v = make_qkv(seed_of("fused-pad"), B=2, Hq=2, Hk=2, Sq=90, Sk=120, Dq=64, dtype=torch.float16)
    k[1, :, 100:] = float("nan")  # padding past cu_seqlen_k is never read
    v[1, :, 100:] = float("nan")
    cu_k = np.array([0, 120, 220], np.int32)
    qs, ks, vs = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    p = check_batch(qs, ks, vs, mask="b", scale=None, layout="bshd", cu_seqlen_q=None, cu_seqlen_k=cu_k)
    mod = fused_module("f16", "bshd", 1, 64)
    out, lse = run_batch(p, True, TILES, lambda: mod, "gpu")
    ref_out, ref_lse = attention_ref(qs, ks, vs, mask="b", layout="bshd", cu_seqlen_k=cu_k)
    assert_close(out, ref_out, torch.float16, what="fused f16 bshd padded")
    assert_close(lse, ref_lse, torch.float16, kind="lse", what="fused f16 bshd padded lse")
