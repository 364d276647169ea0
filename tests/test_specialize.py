"""``fmha_fwd(..., specialize=True)`` on the CPU: a module whose row-block entry points
(``graph.RowBlocks``) are fixed to one shape (Sq == Sk == S, batch, KV heads), checked against the
float64 reference; calls those entries do not take (windows, other shapes) run on the generic
entry points of the same module.

Kernel keys: two specialized CPU modules (f32 bhsd GQA S=256, bf16 bshd S=128)."""

import pytest
import torch

import fmha_iree
from fmha_iree.api import _compiled, dense_kind, run_batch
from fmha_iree.spec import check_batch

from reference import assert_close, attention_ref, make_qkv, seed_of

SHAPES = {
    "f32-bhsd-gqa": dict(dtype=torch.float32, layout="bhsd", B=2, Hq=4, Hk=2, S=256, D=32),
    "bf16-bshd": dict(dtype=torch.bfloat16, layout="bshd", B=1, Hq=2, Hk=2, S=128, D=64),
}
CASES = [
    # (mask, return_lse, entry point; None: the generic plan)
    ("0", True, "dense_s"), ("0", False, "dense_o_s"), ("b", True, "causal_s"), ("t", False, "causal_o_s"),
    ("b:20,0", True, None),  # a window: the plan
]


def _entry(q, k, v, mask, layout, with_lse):
    p = check_batch(q, k, v, mask=mask, scale=None, layout=layout, cu_seqlen_q=None, cu_seqlen_k=None)
    _, get_module, _ = _compiled(p, None, None, True)
    mod = get_module()
    kind = dense_kind(p, mod.dense)
    if not kind:
        return None
    return mod.dense_entry(p.sq, p.sk, kind[0] == "causal", with_lse, window=kind[1])


@pytest.mark.parametrize("mask,with_lse,entry", CASES, ids=[f"{m}-{'lse' if w else 'out'}" for m, w, _ in CASES])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_specialized_cpu_entries(shape, mask, with_lse, entry):
    c = SHAPES[shape]
    q, k, v = make_qkv(seed_of("specialize", shape, mask), B=c["B"], Hq=c["Hq"], Hk=c["Hk"], Sq=c["S"], Sk=c["S"],
                       Dq=c["D"], dtype=c["dtype"], layout=c["layout"])
    got = _entry(q, k, v, mask, c["layout"], with_lse)
    assert got == (f"{entry}{c['S']}" if entry else None)
    res = fmha_iree.fmha_fwd(q, k, v, mask=mask, layout=c["layout"], return_lse=with_lse, specialize=True)
    ref_out, ref_lse = attention_ref(q, k, v, mask=mask, layout=c["layout"])
    out = res[0] if with_lse else res
    assert out.dtype == c["dtype"] and tuple(out.shape) == tuple(ref_out.shape)
    assert_close(out, ref_out, c["dtype"], what=f"{shape} {mask} out")
    if with_lse:
        assert_close(res[1], ref_lse, c["dtype"], kind="lse", what=f"{shape} {mask} lse")


def test_specialized_module_takes_other_shapes():
    """A batch size the module was not fixed to runs on its generic entry points."""
    c = SHAPES["f32-bhsd-gqa"]
    q2, k2, v2 = make_qkv(seed_of("specialize-other2"), B=2, Hq=c["Hq"], Hk=c["Hk"], Sq=c["S"], Sk=c["S"], Dq=c["D"])
    p2 = check_batch(q2, k2, v2, mask="b", scale=None, layout="bhsd", cu_seqlen_q=None, cu_seqlen_k=None)
    tiles, get_module, family = _compiled(p2, None, None, True)  # fixed to B=2
    q, k, v = make_qkv(seed_of("specialize-other"), B=1, Hq=c["Hq"], Hk=c["Hk"], Sq=c["S"], Sk=c["S"], Dq=c["D"])
    p = check_batch(q, k, v, mask="b", scale=None, layout="bhsd", cu_seqlen_q=None, cu_seqlen_k=None)
    assert get_module().dense["batch"] == 2 and dense_kind(p, get_module().dense) is None
    out, lse = run_batch(p, True, tiles, get_module, family)
    ref_out, ref_lse = attention_ref(q, k, v, mask="b")
    assert_close(out, ref_out, torch.float32, what="other batch out")
    assert_close(lse, ref_lse, torch.float32, kind="lse", what="other batch lse")


def test_specialize_must_be_bool():
    q, k, v = make_qkv(seed_of("specialize-type"), B=1, Hq=1, Sq=4, Sk=4, Dq=16)
    with pytest.raises(TypeError, match="specialize"):
        fmha_iree.fmha_fwd(q, k, v, specialize="yes")
