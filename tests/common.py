"""Shared helpers for the fmha_iree tests: one call-and-compare routine.

Compile budget: every distinct (dtype, Hq//Hk, Dq, Dv, layout, tiles, device) compiles a module.
The suite reuses a handful of kernel keys; MAIN below is the workhorse (masks, lengths, padding,
API behaviour), other files add one key per thing they sweep.
"""

from __future__ import annotations

import numpy as np
import torch

import fmha_iree
from reference import assert_close, attention_ref

# The workhorse kernel key: f32 (tightest tolerance), Hq == Hk, d64, bhsd, default tiles.
MAIN = dict(dtype=torch.float32, Dq=64, Dv=64, layout="bhsd")

# Tiles of the GPU kernels' formulation built for llvm-cpu (``ragged_modules``)
RAGGED_TILES = fmha_iree.TileConfig(m0=32, n0=32, k0=16, n1=64, k1=16, kv_chunk=64)

# The GPU formulation built for llvm-cpu (these tests only): IREE's check against large vectors
# allows 512 native vectors per op, 16 KiB on an AVX2 host and 32 KiB with AVX-512, and the ops of
# head dims padded to 128 (Dq 96) hold 32 x 128 f32 tiles, exactly 16 KiB: an AVX2 host refuses
# them (2026-12-03, an AMD EPYC without AVX-512). The check is lifted for these builds; their
# outputs are still compared with float64.
GPU_FORMULATION_CPU_FLAGS = ["--iree-llvmcpu-fail-on-large-vector=false"]


def ragged_modules():
    """``get(dtype, layout, group, dq, dv)``: the GPU modules' formulation (``fwd``,
    ``fwd_ragged``, ``fwd_packed*``) built for llvm-cpu with CUDA's unfused bindings (the frames
    are packed results, read in place), each key compiled once (``gpu_formulation``)."""
    mods = {}

    def get(dtype="f32", layout="bshd", group=2, dq=64, dv=None):
        key = (dtype, layout, group, dq, dv)
        if key not in mods:
            mods[key] = gpu_formulation(dtype, layout, group, dq, dv)
        return mods[key]

    return get


def gpu_formulation(dtype, layout, group, dq, dv=None):
    """An ``FmhaModule`` of the GPU modules' formulation (``RAGGED_TILES``) built for llvm-cpu:
    ``fwd``, the ragged and the packed entry points (CUDA's unfused bindings). Compiled once per
    machine and source: the test processes share the modules through ``_shared_vmfb``."""
    from fmha_iree.compile import ASYNC_FLAGS, CUDA_FLAGS, compile_flags
    from fmha_iree.runtime import FmhaModule
    from fmha_iree.source import dense_abi, fwd_plan, source_mlir
    from fmha_iree.spec import KernelSpec
    from fmha_iree.targets import Target

    spec = KernelSpec(dtype, layout, group, dq, dv or dq, RAGGED_TILES, Target.from_name("host"))
    assert fwd_plan(spec, fused_step=True) is not None
    flags = compile_flags(spec) + ASYNC_FLAGS + CUDA_FLAGS + GPU_FORMULATION_CPU_FLAGS
    vmfb = _shared_vmfb(source_mlir(spec, fused_step=True), flags)
    return FmhaModule(vmfb, "local-task", spec.module_name, typed_bf16=True, layout=layout,
                      dense=dense_abi(spec, fused_step=True))


def _shared_vmfb(mlir: str, flags: list[str]) -> bytes:
    """``mlir`` compiled with ``flags``, through a folder of this machine's temp dir keyed by the
    source, the flags and the compiler's version: the suite's two processes (pytest-xdist) then
    compile each test module once, the second waiting on the first's lock."""
    import fcntl
    import getpass
    import hashlib
    import os
    import tempfile
    from pathlib import Path

    import iree.compiler.tools as ict
    from iree.compiler import version

    key = hashlib.sha256("\0".join([mlir, *flags, str(version.VERSION)]).encode()).hexdigest()[:32]
    folder = Path(tempfile.gettempdir()) / f"fmha_iree_tests_{getpass.getuser()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    path = folder / f"{key}.vmfb"
    with open(folder / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return path.read_bytes()
        vmfb = ict.compile_str(mlir, extra_args=flags)
        tmp = folder / f"{key}.{os.getpid()}.tmp"
        tmp.write_bytes(vmfb)
        os.replace(tmp, path)
        return vmfb


def ids(values, fmt=str):
    return [fmt(v) for v in values]


def cu(lengths):
    """``cu_seqlen_*`` of batches of ``lengths`` (int32 torch, leading 0)."""
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)


def len_id(pair):
    return f"{pair[0]}x{pair[1]}"


def compiles() -> int:
    return int(fmha_iree.cache_stats()["compiles"])


def check_fwd(q, k, v, *, ref_mask=None, mask=None, layout="bhsd", scale=None,
              cu_seqlen_q=None, cu_seqlen_k=None, tiles=None, what="", **extra):
    """Run fmha_fwd(return_lse=True) and compare out and lse to the float64 reference.

    ``mask`` is what fmha_iree gets (string or Mask); ``ref_mask`` what the reference gets
    (defaults to ``mask``, which must then be a string or None).
    Returns (out, lse) as produced by fmha_iree.
    """
    if ref_mask is None and (mask is None or isinstance(mask, str)):
        ref_mask = mask
    kw = dict(mask=mask, scale=scale, return_lse=True, layout=layout, **extra)
    if cu_seqlen_q is not None:
        kw["cu_seqlen_q"] = cu_seqlen_q
    if cu_seqlen_k is not None:
        kw["cu_seqlen_k"] = cu_seqlen_k
    if tiles is not None:
        kw["tiles"] = tiles
    res = fmha_iree.fmha_fwd(q, k, v, **kw)
    assert isinstance(res, tuple) and len(res) == 2, f"return_lse=True must give (out, lse), got {type(res)}"
    out, lse = res

    ref_out, ref_lse = attention_ref(q, k, v, mask=ref_mask, scale=scale, layout=layout,
                                     cu_seqlen_q=cu_seqlen_q, cu_seqlen_k=cu_seqlen_k)
    is_torch = isinstance(q, torch.Tensor)
    if is_torch:
        assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)
        assert out.dtype == q.dtype, f"out dtype {out.dtype} != input {q.dtype}"
        assert lse.dtype == torch.float32, f"lse dtype {lse.dtype}"
        dtype = q.dtype
    else:
        assert isinstance(out, np.ndarray) and isinstance(lse, np.ndarray)
        assert out.dtype == q.dtype, f"out dtype {out.dtype} != input {q.dtype}"
        assert lse.dtype == np.float32, f"lse dtype {lse.dtype}"
        dtype = q.dtype
    assert tuple(out.shape) == ref_out.shape, f"out shape {tuple(out.shape)} != {ref_out.shape}"
    assert tuple(lse.shape) == ref_lse.shape, f"lse shape {tuple(lse.shape)} != {ref_lse.shape}"
    assert_close(out, ref_out, dtype, kind="out", what=what)
    assert_close(lse, ref_lse, dtype, kind="lse", what=what)
    # copies, so that callers comparing against a later call test that call, not buffer reuse
    # (test_api.py::test_results_not_overwritten_by_later_calls tests the aliasing itself)
    return _copy(out), _copy(lse)


def _copy(x):
    return x.clone() if isinstance(x, torch.Tensor) else np.array(x, copy=True)


def configured_attention_tiles(dump_dir):
    """(workgroup, reduction) tile lists of every configured online_attention dispatch that IREE
    dumped into ``dump_dir`` (``--iree-hal-dump-executable-files-to``)."""
    import re

    found = []
    for f in sorted(dump_dir.glob("configured_*.mlir")):
        text = f.read_text()
        if "online_attention" not in text:
            continue
        for m in re.finditer(r"reduction = \[([^\]]*)\], workgroup = \[([^\]]*)\]", text):
            found.append(([int(x) for x in m.group(2).split(",")], [int(x) for x in m.group(1).split(",")]))
    return found
