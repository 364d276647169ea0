"""Bad input: ValueError / TypeError naming the argument, raised before anything is compiled,
and the process stays usable.

The bad calls use a kernel key no other test compiles (f32, d32, bhsd): if validation happened
after compiling, cache_stats()["compiles"] would move.
"""

import re

import numpy as np
import pytest
import torch

import fmha_iree
from common import MAIN, check_fwd, compiles
from reference import make_qkv, seed_of


def good(B=1, Hq=2, Hk=2, Sq=8, Sk=8, Dq=32, Dv=32, dtype=torch.float32, layout="bhsd"):
    return make_qkv(seed_of("errors", B, Hq, Hk, Sq, Sk, Dq, Dv), B=B, Hq=Hq, Hk=Hk, Sq=Sq,
                    Sk=Sk, Dq=Dq, Dv=Dv, dtype=dtype, layout=layout)


def cu(*vals, dtype=torch.int32):
    return torch.tensor(vals, dtype=dtype)


def _with(i, x, qkv):
    t = list(qkv)
    t[i] = x
    return tuple(t)


Q, K, V = 0, 1, 2
ARG_Q, ARG_K, ARG_V = r"\bq\b", r"\bk\b", r"\bv\b"
HEADS = r"\b(q|k|Hq|Hk)\b|head"
DTYPE = r"\b(q|k|v)\b|dtype"

# (id, qkv tuple, kwargs, regex the message must match)
CASES = [
    ("q-3d", _with(Q, good()[0][0], good()), {}, ARG_Q),
    ("q-5d", _with(Q, good()[0][None], good()), {}, ARG_Q),
    ("k-head-dim", _with(K, good(Dq=16)[1], good()), {}, ARG_K),
    ("v-seqlen", _with(V, good(Sk=9)[2], good()), {}, ARG_V),
    ("k-seqlen-vs-v", _with(K, good(Sk=9)[1], good()), {}, r"\b(k|v)\b"),
    ("k-batch", _with(K, good(B=2)[1], good()), {}, r"\b(k|q)\b|batch"),
    ("v-heads", _with(V, good(Hk=1)[2], good()), {}, r"\b(k|v)\b"),
    ("heads-not-divisible", good(Hq=3, Hk=2), {}, HEADS),
    ("kv-more-heads-than-q", good(Hq=2, Hk=4), {}, HEADS),
    ("mixed-dtypes", _with(K, good()[1].half(), good()), {}, DTYPE),
    ("float64", tuple(x.double() for x in good()), {}, DTYPE),
    ("int32", tuple((x * 10).int() for x in good()), {}, DTYPE),
    ("numpy-float64", tuple(x.double().numpy() for x in good()), {}, DTYPE),
    ("list-input", _with(Q, good()[0].tolist(), good()), {}, ARG_Q),
    ("mask-unknown", good(), dict(mask="zz"), "mask"),
    ("mask-3", good(), dict(mask="3"), "mask"),
    ("mask-missing-right", good(), dict(mask="t:1"), "mask"),
    ("mask-not-ints", good(), dict(mask="b:a,b"), "mask"),
    ("mask-x-empty", good(), dict(mask="xt:"), "mask"),
    ("mask-bad-prefix", good(), dict(mask="q:1,2"), "mask"),
    ("mask-wrong-type", good(), dict(mask=3.5), "mask"),
    ("layout-unknown", good(), dict(layout="bsdh"), "layout"),
    ("layout-sbhd", good(), dict(layout="sbhd"), "layout"),
    ("cu_q-past-tensor", good(B=2), dict(cu_seqlen_q=cu(0, 8, 17)), "cu_seqlen_q"),
    ("cu_q-wrong-length", good(B=2), dict(cu_seqlen_q=cu(0, 8)), "cu_seqlen_q"),
    ("cu_q-non-monotonic", good(B=2), dict(cu_seqlen_q=cu(0, 5, 3)), "cu_seqlen_q"),
    ("cu_q-float", good(B=2), dict(cu_seqlen_q=cu(0, 4, 8, dtype=torch.float32)),
     "cu_seqlen_q"),
    ("cu_k-past-tensor", good(B=2), dict(cu_seqlen_k=cu(0, 9, 10)), "cu_seqlen_k"),
    ("cu_k-wrong-length", good(B=2), dict(cu_seqlen_k=cu(0, 1, 2, 3)), "cu_seqlen_k"),
    ("cu_k-2d", good(B=2), dict(cu_seqlen_k=cu(0, 1, 2)[None]), "cu_seqlen_k"),
    ("device-unknown", good(), dict(device="nope"), "device"),
    ("device-bad-driver", good(), dict(device="nope://0"), "device"),
    ("device-bad-index", good(), dict(device="cuda://banana"), "device"),
    ("device-cpu-index", good(), dict(device="local-task://99"), "device"),
    ("tiles-wrong-type", good(), dict(tiles="128x128"), "tiles"),
    # finite in float64, inf in float32 (the kernels' type): gave all-NaN output
    ("scale-past-f32", good(), dict(scale=1e39), "scale"),
    ("scale-neg-past-f32", good(), dict(scale=-3.5e38), "scale"),
    ("scale-nan", good(), dict(scale=float("nan")), "scale"),
    ("scale-tensor", good(), dict(scale=torch.tensor(0.1)), "scale"),
    # meta / sparse / nested tensors raised torch's own errors, naming no argument
    ("q-meta", _with(Q, good()[0].to("meta"), good()), {}, ARG_Q),
    ("k-sparse", _with(K, good()[1].to_sparse(), good()), {}, ARG_K),
    ("v-sparse-csr", _with(V, good()[2][0, 0].to_sparse_csr(), good()), {}, ARG_V),
    # no backward pass: an input that wants a gradient got an output without one, silently
    ("q-requires-grad", _with(Q, good()[0].requires_grad_(), good()), {}, ARG_Q),
    ("v-requires-grad", _with(V, good()[2].requires_grad_(), good()), {}, ARG_V),
]


@pytest.fixture(scope="module")
def main_problem():
    """A valid MAIN-key problem, run once so it is compiled (or loaded) before the error tests."""
    q, k, v = make_qkv(seed_of("errors-valid"), B=1, Hq=2, Sq=13, Sk=21, Dq=MAIN["Dq"])
    fmha_iree.fmha_fwd(q, k, v, mask="b", return_lse=True)
    return q, k, v


@pytest.mark.parametrize("name,qkv,kwargs,pattern", CASES, ids=[c[0] for c in CASES])
def test_bad_input(main_problem, name, qkv, kwargs, pattern):
    before = compiles()
    with pytest.raises((ValueError, TypeError)) as ei:
        fmha_iree.fmha_fwd(*qkv, return_lse=True, **kwargs)
    msg = str(ei.value)
    assert re.search(pattern, msg), f"message does not name the argument ({pattern}): {msg!r}"
    assert compiles() == before, "a bad call compiled a module before rejecting its input"
    # still usable
    q, k, v = main_problem
    check_fwd(q, k, v, mask="b", what=f"after {name}")
    assert compiles() == before


def test_tile_config_rejects_nonsense():
    for bad in (dict(m0=0), dict(n0=-16)):
        with pytest.raises((ValueError, TypeError)):
            fmha_iree.TileConfig(**bad)


def test_mask_from_str_rejects_unknown():
    for bad in ("zz", "t:1", "xt:", ""):
        with pytest.raises(ValueError):
            fmha_iree.Mask.from_str(bad)


def test_numpy_bad_input_then_numpy_ok(main_problem):
    q, k, v = (x.numpy() for x in main_problem)
    before = compiles()
    with pytest.raises((ValueError, TypeError)) as ei:
        fmha_iree.fmha_fwd(q, k[:, :, :, :16], v)
    assert re.search(ARG_K, str(ei.value)), str(ei.value)
    out = fmha_iree.fmha_fwd(q, k, v, mask="b")
    assert isinstance(out, np.ndarray) and compiles() == before


def test_device_tensor_misuse(main_problem):
    """DeviceTensors: mixing them with host arrays, or passing them for another device, is refused
    naming the argument, before anything runs."""
    q, k, v = main_problem
    qd = fmha_iree.to_device(q, "local-task")
    before = compiles()
    with pytest.raises(TypeError, match=r"\bk\b"):
        fmha_iree.fmha_fwd(qd, k, v)
    with pytest.raises(ValueError, match="device"):
        fmha_iree.fmha_fwd(qd, *(fmha_iree.to_device(x, "local-task") for x in (k, v)), device="local-sync")
    with pytest.raises(ValueError, match="reshape"):
        qd.reshape((3, 5))
    with pytest.raises(TypeError, match=r"\bx\b"):
        fmha_iree.to_device([1.0, 2.0], "local-task")
    assert compiles() == before
    out = fmha_iree.fmha_fwd(qd, *(fmha_iree.to_device(x, "local-task") for x in (k, v)), mask="b")
    assert isinstance(out, fmha_iree.DeviceTensor)
    check_fwd(q, k, v, mask="b", what="after DeviceTensor misuse")
    assert torch.allclose(out.to_torch(), fmha_iree.fmha_fwd(q, k, v, mask="b"))


def test_unavailable_device_is_refused_before_compiling(main_problem):
    """A device that cannot be opened (no GPU here) is a ValueError naming it within seconds,
    before anything compiles."""
    import time

    from fmha_iree.runtime.device import get_device

    try:
        get_device("cuda://0")
    except ValueError:
        pass
    else:
        pytest.skip("this machine has a CUDA device")
    q, k, v = main_problem
    before, t0 = compiles(), time.perf_counter()
    with pytest.raises(ValueError, match="device 'cuda://0'"):
        fmha_iree.fmha_fwd(q, k, v, device="cuda://0")
    assert time.perf_counter() - t0 < 5 and compiles() == before


def test_requires_grad_runs_when_detached_or_under_no_grad(main_problem):
    """The refusal of inputs that require grad is about the gradient only: detached, or under
    ``torch.no_grad()``, the same tensors run."""
    q, k, v = main_problem
    qg = q.clone().requires_grad_()
    with torch.no_grad():
        a = fmha_iree.fmha_fwd(qg, k, v, mask="b")
    b = fmha_iree.fmha_fwd(qg.detach(), k, v, mask="b")
    check_fwd(q, k, v, mask="b", what="reference")
    assert torch.equal(a, b) and not a.requires_grad


def test_scale_at_float32_edge_is_accepted(main_problem):
    """The largest float32 is a valid scale (not every large value is refused)."""
    q, k, v = main_problem
    out = fmha_iree.fmha_fwd(q * 0, k, v, scale=float(np.finfo(np.float32).max) / 2)
    assert torch.isfinite(out).all()


def test_rows_past_32_bits_are_refused(main_problem, monkeypatch):
    """The kernels index rows (a tensor's axes but the head dim) in 32 bits; a tensor with more is
    a ValueError naming it, in batch and group mode (the bound lowered so that a small tensor
    crosses it)."""
    import fmha_iree.problem.spec as spec

    q, k, v = good(B=2, Hq=2, Sq=8, Sk=24)
    monkeypatch.setattr(spec, "ROWS_MAX", 2 * 2 * 16)
    before = compiles()
    with pytest.raises(ValueError, match=r"\bk has 96 rows"):
        fmha_iree.fmha_fwd(q, k, v)
    packed = [x.transpose(1, 2).reshape(-1, 2, 32) for x in (q, k, v)]
    with pytest.raises(ValueError, match=r"\bk has 96 rows"):  # 48 tokens x 2 heads
        fmha_iree.fmha_fwd_varlen(*packed, seqstart_q=[0, 8, 16], seqstart_k=[0, 24, 48])
    assert compiles() == before
    monkeypatch.undo()
    q, k, v = main_problem
    check_fwd(q, k, v, mask="b", what="after the row bound")


def test_cuda_allocator_policy_from_the_environment():
    """CUDA devices keep released buffers (IREE's stream-ordered allocations off, its caching
    allocator on) unless the environment says otherwise; a bad setting is a ValueError naming the
    variable; other devices keep IREE's defaults."""
    from fmha_iree.runtime.allocation import CUDA_CACHE_DEFAULT, CUDA_CACHE_ENV, AllocatorPolicy, allocator_policy

    p = allocator_policy("cuda://0", {})
    assert p.flags == ("--cuda_async_allocations=false",) and p.budget == CUDA_CACHE_DEFAULT
    assert len(p.allocators) == 1 and p.allocators[0].startswith("caching:device_local=")
    assert allocator_policy("cuda", {CUDA_CACHE_ENV: "1048576"}).budget == 1048576
    off = allocator_policy("cuda", {CUDA_CACHE_ENV: "0"})
    assert off.allocators == () and off.budget == 0
    user = allocator_policy("cuda", {"IREE_PY_RUNTIME_FLAGS": "--cuda_async_allocations=true"})
    assert user.flags == () and user.allocators
    for uri in ("local-task", "hip://0", "vulkan"):
        assert allocator_policy(uri, {}) == AllocatorPolicy()
    for bad in ("8g", "-1"):
        with pytest.raises(ValueError, match=CUDA_CACHE_ENV):
            allocator_policy("cuda", {CUDA_CACHE_ENV: bad})


def test_warns_when_iree_opened_the_driver_first(monkeypatch):
    """Where IREE's own device of a driver was opened before fmha_iree's, the driver keeps the
    flags it was made with (fmha_iree's allocation policy cannot apply): a RuntimeWarning says so
    and how to avoid it; none for another driver's device."""
    import warnings

    from iree.runtime import system_setup

    from fmha_iree.runtime.device import _warn_if_driver_exists

    monkeypatch.setattr(system_setup, "_GLOBAL_DEVICES_BY_URI", {"local-task": object()})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn_if_driver_exists("cuda://0")
    monkeypatch.setattr(system_setup, "_GLOBAL_DEVICES_BY_URI", {"cuda://0": object()})
    with pytest.warns(RuntimeWarning, match="cuda_async_allocations=false"):
        _warn_if_driver_exists("cuda://0")


def test_cache_keeper_bounds_the_kept_bytes():
    """IREE's caching allocator (on the CPU device here, the same code as on CUDA) keeps released
    buffers; the keeper returns them once the device's allocations grew by more than its budget
    or after enough calls missed the cache, and not before. The allocator's statistics count every
    local-task device of the process (a buffer held on one shows on another: IREE 3.13), so the
    bytes held are read against what the process held when the test began."""
    import iree.runtime as rt

    from fmha_iree.runtime.allocation import CacheKeeper, allocator_policy

    spec = allocator_policy("cuda", {}).allocators
    dev = rt.get_driver("local-task").create_device_by_uri("local-task", allocators=list(spec))
    alloc = dev.allocator

    def buf(n):
        return alloc.allocate_buffer(memory_type=rt.MemoryType.DEVICE_LOCAL, allowed_usage=rt.BufferUsage.DEFAULT,
                                     allocation_size=n)

    def held_now():
        s = alloc.statistics
        return s["device_bytes_allocated"] - s["device_bytes_freed"]

    before = held_now()  # buffers other tests' devices still hold

    def held():
        return held_now() - before

    keeper = CacheKeeper(alloc, budget=4 << 20, misses=8)
    for _ in range(5):  # one size again and again: served from the cache, nothing returned
        b = buf(1 << 20)
        del b
        keeper.after_call()
    assert keeper.trims == 0 and (1 << 20) <= held() < (2 << 20)  # (plus the device's own few bytes)
    for i in range(3):  # new 2 MB sizes: the second passes the budget and all are returned
        b = buf((2 << 20) + i * 4096)
        del b
        keeper.after_call()
    assert keeper.trims == 1 and (2 << 20) <= held() < (3 << 20)  # the third one is kept
    for i in range(8):  # small new sizes, under the budget: returned at the 8th miss since the last
        b = buf(4096 * (i + 1))
        del b
        keeper.after_call()
    assert keeper.trims == 2 and held() < (64 << 10)
