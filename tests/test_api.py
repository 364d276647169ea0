"""API behaviour: torch / numpy in and out, return_lse, scale, device, NaN isolation, long
sequences, and the compile cache (same kernel key -> no new compile).

Kernel keys: MAIN, f16-d64-bhsd (test_dtypes.py), f32-d64-bshd (test_layouts_gqa.py),
f32-gqa2/mqa4 (test_layouts_gqa.py). Nothing new.
"""

import math

import numpy as np
import pytest
import torch

import fmha_iree
from common import MAIN, check_fwd, compiles
from reference import assert_close, attention_ref, make_qkv, seed_of


@pytest.mark.parametrize("np_dtype,layout", [(np.float32, "bhsd"), (np.float16, "bhsd"),
                                             (np.float32, "bshd")],
                         ids=["f32-bhsd", "f16-bhsd", "f32-bshd"])
def test_numpy_in_numpy_out(np_dtype, layout):
    q, k, v = make_qkv(seed_of("numpy", np_dtype, layout), B=2, Hq=2, Sq=45, Sk=77, Dq=64,
                       layout=layout)
    qn, kn, vn = (x.numpy().astype(np_dtype) for x in (q, k, v))
    out, lse = check_fwd(qn, kn, vn, mask="b:5,5", layout=layout, what="numpy")
    assert isinstance(out, np.ndarray) and out.dtype == np_dtype
    assert isinstance(lse, np.ndarray) and lse.dtype == np.float32
    out_only = fmha_iree.fmha_fwd(qn, kn, vn, mask="b:5,5", layout=layout)
    assert isinstance(out_only, np.ndarray) and out_only.dtype == np_dtype
    np.testing.assert_array_equal(out_only, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_torch_in_torch_out(dtype):
    q, k, v = make_qkv(seed_of("torch-io", dtype), B=1, Hq=2, Sq=10, Sk=12, Dq=64, dtype=dtype)
    out = fmha_iree.fmha_fwd(q, k, v)
    assert isinstance(out, torch.Tensor) and not isinstance(out, tuple)
    assert out.dtype == dtype and tuple(out.shape) == (1, 2, 10, 64) and out.device.type == "cpu"
    ref, _ = attention_ref(q, k, v)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_results_not_overwritten_by_later_calls(kind):
    """A returned out / lse is the caller's: later calls (same kernel, same or other shapes)
    must not write into it."""
    q, k, v = make_qkv(seed_of("alias", kind), B=2, Hq=2, Sq=50, Sk=61, Dq=64)
    q2, k2, v2 = make_qkv(seed_of("alias2", kind), B=2, Hq=2, Sq=50, Sk=61, Dq=64)
    conv = (lambda x: x) if kind == "torch" else (lambda x: x.numpy())
    out, lse = fmha_iree.fmha_fwd(conv(q), conv(k), conv(v), mask="b", return_lse=True)
    ref_out, ref_lse = attention_ref(q, k, v, mask="b")
    fmha_iree.fmha_fwd(conv(q2), conv(k2), conv(v2), mask="b", return_lse=True)  # same problem
    fmha_iree.fmha_fwd(conv(q2), conv(k2), conv(v2), mask="t", return_lse=True)  # other mask
    fmha_iree.fmha_fwd(conv(q2[:, :, :9]), conv(k2), conv(v2), return_lse=True)  # smaller
    assert_close(out, ref_out, torch.float32, what="first result after later calls")
    assert_close(lse, ref_lse, torch.float32, kind="lse", what="first result after later calls")


def test_inputs_not_modified():
    q, k, v = make_qkv(seed_of("no-modify"), B=1, Hq=2, Sq=20, Sk=20, Dq=64)
    copies = [x.clone() for x in (q, k, v)]
    fmha_iree.fmha_fwd(q, k, v, mask="t", return_lse=True)
    for a, b in zip((q, k, v), copies):
        assert torch.equal(a, b)



def test_layout_as_a_numpy_string():
    """A ``numpy.str_`` layout (a str subclass, as ``np.random.choice`` gives) computes as the
    str does and reaches the kernel spec as a plain str (the torch-exported graph rejects numpy
    values at compile time)."""
    from fmha_iree.problem.spec import check_batch

    q, k, v = make_qkv(seed_of("np-str-layout"), B=2, Hq=2, Sq=30, Sk=41, Dq=64, layout="bshd")
    check_fwd(q, k, v, mask="b:4,2", layout=np.str_("bshd"), what="numpy.str_ layout")
    p = check_batch(q, k, v, mask=None, scale=None, layout=np.str_("bshd"), cu_seqlen_q=None, cu_seqlen_k=None)
    assert type(p.layout) is str  # what BatchProblem.kernel puts into the spec

@pytest.mark.parametrize("scale", [0.05, 0.3, 1.0, -0.5, 3.0], ids=lambda s: f"scale{s}")
def test_explicit_scale(scale):
    q, k, v = make_qkv(seed_of("scale", scale), B=1, Hq=2, Sq=33, Sk=65, Dq=64)
    check_fwd(q, k, v, mask="b", scale=scale, what=f"scale={scale}")


def test_default_scale_is_inv_sqrt_dq():
    q, k, v = make_qkv(seed_of("default-scale"), B=1, Hq=2, Sq=20, Sk=30, Dq=64)
    a = fmha_iree.fmha_fwd(q, k, v, mask="t").clone()
    b = fmha_iree.fmha_fwd(q, k, v, mask="t", scale=1 / math.sqrt(64))
    assert_close(a, b.double().numpy(), torch.float32)


@pytest.mark.parametrize("device", [None, "local-task"], ids=["default", "local-task"])
def test_device_argument(device):
    q, k, v = make_qkv(seed_of("device", device), B=1, Hq=2, Sq=9, Sk=17, Dq=64)
    check_fwd(q, k, v, mask="b", device=device)


@pytest.mark.parametrize("where", ["q-row", "k-row"])
def test_nan_row_isolation(where):
    """NaN in one row of q poisons that output row only; NaN in key j poisons only the rows that
    may see key j (here with a causal mask)."""
    q, k, v = make_qkv(seed_of("nan", where), B=2, Hq=2, Sq=40, Sk=40, Dq=64)
    if where == "q-row":
        q[1, 0, 17, 5] = float("nan")
    else:
        k[1, 0, 17, 5] = float("nan")
    out, lse = fmha_iree.fmha_fwd(q, k, v, mask="t", return_lse=True)
    ref_out, ref_lse = attention_ref(q, k, v, mask="t")
    nan_rows = torch.isnan(out).any(dim=-1)
    expect = np.isnan(ref_out).any(axis=-1)
    if where == "q-row":
        assert expect.sum() == 1 and expect[1, 0, 17]
    else:
        assert expect.sum() == 40 - 17 and expect[1, 0, 17:].all()  # rows i >= 17 see key 17
    np.testing.assert_array_equal(nan_rows.numpy(), expect, err_msg="NaN rows differ")
    assert torch.isnan(out[torch.from_numpy(expect)]).all(), "NaN rows must be NaN throughout"
    assert_close(out, ref_out, torch.float32, what="nan isolation")
    assert_close(lse, ref_lse, torch.float32, kind="lse", what="nan isolation")


def test_long_sequence():
    """A longer problem than the rest of the suite (several 128/256 tiles in both directions)."""
    q, k, v = make_qkv(seed_of("long"), B=1, Hq=1, Sq=1000, Sk=1100, Dq=64)
    for mask in ("0", "b", "t:300,0"):
        check_fwd(q, k, v, mask=mask, what=f"long mask={mask}")


def test_repeated_problems_do_not_recompile():
    """Different lengths, masks, batch sizes and head counts (same Hq/Hk ratio), padding and
    scale reuse a compiled kernel."""
    d = MAIN["Dq"]
    # warm the keys used below (compiled now or by earlier tests, or loaded from disk)
    for hq, hk in ((2, 2), (4, 2)):
        q, k, v = make_qkv(1, B=1, Hq=hq, Hk=hk, Sq=3, Sk=5, Dq=d)
        fmha_iree.fmha_fwd(q, k, v, return_lse=True)
    before = compiles()
    cases = [
        dict(B=1, Hq=2, Hk=2, Sq=1, Sk=1, mask="0"),
        dict(B=2, Hq=2, Hk=2, Sq=300, Sk=7, mask="b"),
        dict(B=1, Hq=1, Hk=1, Sq=129, Sk=257, mask="t:3,9"),
        dict(B=2, Hq=3, Hk=3, Sq=64, Sk=64, mask="xb:17"),
        dict(B=1, Hq=4, Hk=4, Sq=77, Sk=130, mask=fmha_iree.Mask.causal(top_left=True)),
        dict(B=1, Hq=4, Hk=2, Sq=50, Sk=60, mask="b:-1,4"),
        dict(B=2, Hq=8, Hk=4, Sq=33, Sk=200, mask="t"),
        dict(B=3, Hq=2, Hk=1, Sq=5, Sk=5, mask="0"),
    ]
    for i, c in enumerate(cases):
        q, k, v = make_qkv(seed_of("nocompile", i), B=c["B"], Hq=c["Hq"], Hk=c["Hk"], Sq=c["Sq"],
                           Sk=c["Sk"], Dq=d)
        res = fmha_iree.fmha_fwd(q, k, v, mask=c["mask"], return_lse=True)
        assert compiles() == before, f"case {i} ({c}) compiled a new module"
        assert res[0].shape == (c["B"], c["Hq"], c["Sq"], d)
    # padding and an explicit scale
    q, k, v = make_qkv(seed_of("nocompile-pad"), B=2, Hq=2, Sq=40, Sk=50, Dq=d)
    fmha_iree.fmha_fwd(q, k, v, mask="b", return_lse=True, scale=0.2,
                       cu_seqlen_q=torch.tensor([0, 3, 43], dtype=torch.int32),
                       cu_seqlen_k=torch.tensor([0, 50, 51], dtype=torch.int32))
    assert compiles() == before, "cu_seqlen / scale compiled a new module"
    stats = fmha_iree.cache_stats()
    assert isinstance(stats, dict) and "compiles" in stats
