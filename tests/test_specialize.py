"""``fmha_fwd(..., specialize=True)`` on the CPU: a module whose row-block entry points
(``rows.RowBlocks``) are fixed to one shape (Sq == Sk == S, batch, KV heads), checked against the
float64 reference; calls those entries do not take (windows, other shapes) run on the generic
entry points of the same module.

Kernel keys: two specialized CPU modules (f32 bhsd GQA S=256, bf16 bshd S=128)."""

import subprocess
import sys

import pytest
import torch

import fmha_iree
from fmha_iree.paths import policy

from reference import assert_close, attention_ref, make_qkv, seed_of

SHAPES = {
    "f32-bhsd-gqa": dict(dtype=torch.float32, layout="bhsd", B=2, Hq=4, Hk=2, S=256, D=32),
    "bf16-bshd": dict(dtype=torch.bfloat16, layout="bshd", B=1, Hq=2, Hk=2, S=128, D=64),
}
CASES = [
    # (mask, return_lse, entry point; None: the generic plan)
    ("0", True, "dense_s"), ("0", False, "dense_o_s"), ("b", True, "causal_s"), ("t", False, "causal_o_s"),
    ("b:20,0", True, None),  # a window: the generic entry points (bshd: group mode; rows for short queries, else units)
]


def _entry(q, k, v, mask, layout, with_lse):
    """The entry point ``fmha_fwd(..., specialize=True)`` runs (``fmha_iree.route``)."""
    return fmha_iree.route(q, k, v, mask=mask, layout=layout, return_lse=with_lse, specialize=True).entry


@pytest.mark.parametrize("mask,with_lse,entry", CASES, ids=[f"{m}-{'lse' if w else 'out'}" for m, w, _ in CASES])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_specialized_cpu_entries(shape, mask, with_lse, entry):
    c = SHAPES[shape]
    q, k, v = make_qkv(seed_of("specialize", shape, mask), B=c["B"], Hq=c["Hq"], Hk=c["Hk"], Sq=c["S"], Sk=c["S"],
                       Dq=c["D"], dtype=c["dtype"], layout=c["layout"])
    got = _entry(q, k, v, mask, c["layout"], with_lse)
    short = c["S"] * c["Hq"] // c["Hk"] <= policy.ROWS_MAX_ROWS
    group = policy.BATCH_WAVE_MIN_ROWS <= c["S"] <= min(policy.BATCH_WAVE_MAX_KEYS, policy.WAVE_MAX_ROWS)
    assert got == (f"{entry}{c['S']}" if entry else "waves_varlen" if group else "rows" if short else "units")
    res = fmha_iree.fmha_fwd(q, k, v, mask=mask, layout=c["layout"], return_lse=with_lse, specialize=True)
    ref_out, ref_lse = attention_ref(q, k, v, mask=mask, layout=c["layout"])
    out = res[0] if with_lse else res
    assert out.dtype == c["dtype"] and tuple(out.shape) == tuple(ref_out.shape)
    assert_close(out, ref_out, c["dtype"], what=f"{shape} {mask} out")
    if with_lse:
        assert_close(res[1], ref_lse, c["dtype"], kind="lse", what=f"{shape} {mask} lse")


def test_specialized_module_takes_other_shapes(tmp_path):
    """A module fixed to B=2 (``fmha-iree compile --seqlens 256 --batch 2``) runs a B=1 call on its
    generic entry points (here group mode's ``waves_varlen``), and a B=2 call on the compiled-in one."""
    c = SHAPES["f32-bhsd-gqa"]
    vmfb = tmp_path / "b2.vmfb"
    subprocess.run([sys.executable, "-m", "fmha_iree.cli", "compile", "--target", "host", "--dtype", "f32",
                    "--hdim", str(c["D"]), "--heads", f"{c['Hq']}:{c['Hk']}", "--seqlens", str(c["S"]), "--batch", "2",
                    "-o", str(vmfb)], check=True, capture_output=True)
    f = fmha_iree.load(vmfb)
    shape = dict(Hq=c["Hq"], Hk=c["Hk"], Sq=c["S"], Sk=c["S"], Dq=c["D"])
    q2, k2, v2 = make_qkv(seed_of("specialize-other2"), B=2, **shape)
    r = f.route(q2, k2, v2, mask="b")  # out only, as the calls below
    assert (r.path, r.entry) == ("compiled_in", f"causal_o_s{c['S']}"), str(r)
    assert f.route(q2, k2, v2, mask="b", return_lse=True).entry == f"causal_s{c['S']}"
    ref2, _ = attention_ref(q2, k2, v2, mask="b")
    d2 = [fmha_iree.to_device(x) for x in (q2, k2, v2)]
    for _ in range(3):  # the first call prepares, the others replay (DeployedFmha's PreparedCalls)
        assert_close(f(*d2, mask="b").to_torch(), ref2, torch.float32, what="deployed replay")
    q, k, v = make_qkv(seed_of("specialize-other"), B=1, **shape)
    r = f.route(q, k, v, mask="b", return_lse=True)
    assert (r.path, r.entry) == ("cpu_group", "waves_varlen"), str(r)
    assert "compiled_in" in dict(r.rejected), str(r)  # fixed to B=2
    out, lse = f(q, k, v, mask="b", return_lse=True)
    ref_out, ref_lse = attention_ref(q, k, v, mask="b")
    assert_close(out, ref_out, torch.float32, what="other batch out")
    assert_close(lse, ref_lse, torch.float32, kind="lse", what="other batch lse")


def test_specialize_must_be_bool():
    q, k, v = make_qkv(seed_of("specialize-type"), B=1, Hq=1, Sq=4, Sk=4, Dq=16)
    with pytest.raises(TypeError, match="specialize"):
        fmha_iree.fmha_fwd(q, k, v, specialize="yes")


def test_repeated_device_calls_replay_and_stay_checked():
    """A repeated call on DeviceTensors replays its validated, routed form (``PreparedCalls``):
    results match the reference on every repeat and for each mask and LSE choice, and arguments
    that differ only in type (``return_lse=1``) or are invalid are still refused."""
    c = SHAPES["f32-bhsd-gqa"]
    q, k, v = make_qkv(seed_of("prepared"), B=c["B"], Hq=c["Hq"], Hk=c["Hk"], Sq=c["S"], Sk=c["S"], Dq=c["D"])
    qd, kd, vd = (fmha_iree.to_device(x) for x in (q, k, v))
    for mask in ("0", "b", "0", "t:5,0"):
        ref_out, ref_lse = attention_ref(q, k, v, mask=mask)
        for _ in range(2):
            out, lse = fmha_iree.fmha_fwd(qd, kd, vd, mask=mask, return_lse=True, specialize=True)
            assert_close(out.to_torch(), ref_out, torch.float32, what=f"replayed {mask} out")
            assert_close(lse.to_torch(), ref_lse, torch.float32, kind="lse", what=f"replayed {mask} lse")
            out = fmha_iree.fmha_fwd(qd, kd, vd, mask=mask, specialize=True)
            assert_close(out.to_torch(), ref_out, torch.float32, what=f"replayed {mask} out only")
    from fmha_iree.api import PREPARED

    assert len(PREPARED) >= 4  # "0" and "b", with and without LSE (the window takes the plan: not kept)
    with pytest.raises(TypeError, match="return_lse"):
        fmha_iree.fmha_fwd(qd, kd, vd, mask="0", return_lse=1, specialize=True)
    with pytest.raises(ValueError, match="scale"):
        fmha_iree.fmha_fwd(qd, kd, vd, mask="0", scale=1e39, specialize=True)
