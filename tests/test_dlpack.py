"""DLPack both ways on the CPU device: ``DeviceTensor.from_dlpack`` shares a torch tensor's memory
(no copy), and ``torch.from_dlpack`` views a DeviceTensor result; calls on imported tensors match
the float64 reference, and a viewed result is not overwritten by later calls.
Kernel key: the workhorse f32 g1 d64 bhsd.
"""

from __future__ import annotations

import numpy as np
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


def test_a_capsule_import_shares_memory_and_keeps_its_owner_alive():
    """``DeviceTensor.from_capsule`` (the per-call import of torch GPU tensors, ``torch_gpu``):
    the same memory as the tensor, which it keeps alive, typed as the tensor is."""
    import gc

    from torch.utils.dlpack import to_dlpack

    q, k, v = make_qkv(seed_of("capsule"), B=1, Hq=2, Sq=17, Sk=40, Dq=64)
    ref = attention_ref(q, k, v, mask="t")[0]
    qd, kd, vd = (DeviceTensor.from_capsule(to_dlpack(x), "local-task", x.shape, "f32", x) for x in (q, k, v))
    del q, k, v
    gc.collect()  # the imports keep the tensors' memory
    assert_close(torch.from_dlpack(fmha_iree.fmha_fwd(qd, kd, vd, mask="t")), ref, torch.float32, what="capsule")
    for dt, name in ((torch.bfloat16, "bf16"), (torch.float16, "f16")):
        x = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(dt)
        t = DeviceTensor.from_capsule(to_dlpack(x), "local-task", x.shape, name, x)
        x.add_(1)  # a write to the tensor shows through
        got = torch.from_numpy(t.to_numpy())
        assert torch.equal(got.view(dt) if name == "bf16" else got, x)


def test_import_refuses_what_it_cannot_share():
    x = torch.randn(2, 3, 4, 5)
    with pytest.raises(ValueError, match="contiguous"):
        DeviceTensor.from_dlpack(x.transpose(1, 2))
    with pytest.raises(TypeError, match="dtype"):
        DeviceTensor.from_dlpack(x.double())
    with pytest.raises(ValueError, match="device"):
        DeviceTensor.from_dlpack(x, "cuda://0")


class _FakeDevice:
    def __init__(self, index):
        self.type, self.index = "cuda", index

    def __eq__(self, other):
        return isinstance(other, _FakeDevice) and other.index == self.index

    def __repr__(self):
        return f"cuda:{self.index}"


class _FakeGpuTensor:
    """Stands for a torch CUDA tensor where torch has no GPU: what ``torch_gpu`` looks at."""

    __module__ = "torch.fake"

    def __init__(self, index):
        self.device = _FakeDevice(index)


def test_torch_gpu_tensors_pick_their_gpu_or_are_refused_by_name():
    """torch GPU tensors choose the IREE device of their GPU; tensors on two GPUs, beside CPU
    tensors, or on another device than ``device`` names are a ValueError naming the argument;
    anything else (CPU tensors, numpy, DeviceTensors) takes the usual path."""
    import torch

    from fmha_iree.runtime.torch_gpu import torch_gpu

    g0, g1 = _FakeGpuTensor(0), _FakeGpuTensor(1)
    drv = "hip" if getattr(torch.version, "hip", None) else "cuda"
    assert torch_gpu({"q": g0, "k": g0, "v": g0}, None).uri == f"{drv}://0"
    assert torch_gpu({"q": g1, "k": g1, "v": g1}, f"{drv}://1").uri == f"{drv}://1"
    with pytest.raises(ValueError, match="^k is on cuda:1 but q on cuda:0"):
        torch_gpu({"q": g0, "k": g1, "v": g0}, None)
    with pytest.raises(ValueError, match="^v is on cpu"):
        torch_gpu({"q": g0, "k": g0, "v": torch.zeros(1)}, None)
    with pytest.raises(ValueError, match="but device is 'local-task'"):
        torch_gpu({"q": g0, "k": g0, "v": g0}, "local-task")
    assert torch_gpu({"q": torch.zeros(1), "k": np.zeros(1), "v": None}, "cuda://0") is None
