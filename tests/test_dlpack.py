"""DLPack both ways on the CPU device: ``DeviceTensor.from_dlpack`` shares a torch tensor's memory
(no copy), and ``torch.from_dlpack`` views a DeviceTensor result; calls on imported tensors match
the float64 reference, and a viewed result is not overwritten by later calls.
Kernel key: the workhorse f32 g1 d64 bhsd.
"""

from __future__ import annotations

import pytest
import torch

import fmha_iree
from fmha_iree import DeviceTensor
from reference import assert_close, attention_ref, make_qkv, seed_of


def test_import_shares_memory_and_export_views_results():
    q, k, v = make_qkv(seed_of("dlpack"), B=2, Hq=2, Sq=19, Sk=33, Dq=64)
    qd, kd, vd = (DeviceTensor.from_dlpack(x, "local-task") for x in (q, k, v))
    out, lse = fmha_iree.fmha_fwd(qd, kd, vd, mask="b", return_lse=True)
    assert isinstance(out, DeviceTensor)
    o1 = torch.from_dlpack(out)
    ref_out, ref_lse = attention_ref(q, k, v, mask="b")
    assert_close(o1, ref_out, torch.float32, what="dlpack out")
    assert_close(torch.from_dlpack(lse), ref_lse, torch.float32, kind="lse", what="dlpack lse")
    kept = o1.clone()
    q.mul_(0.5)  # the import shares q's memory: the next call sees the new values
    out2 = fmha_iree.fmha_fwd(qd, kd, vd, mask="b")
    assert_close(torch.from_dlpack(out2), attention_ref(q, k, v, mask="b")[0], torch.float32, what="after a write")
    assert torch.equal(o1, kept), "a result viewed through DLPack changed under a later call"


def test_import_refuses_what_it_cannot_share():
    x = torch.randn(2, 3, 4, 5)
    with pytest.raises(ValueError, match="contiguous"):
        DeviceTensor.from_dlpack(x.transpose(1, 2))
    with pytest.raises(TypeError, match="dtype"):
        DeviceTensor.from_dlpack(x.double())
    with pytest.raises(ValueError, match="device"):
        DeviceTensor.from_dlpack(x, "cuda://0")
