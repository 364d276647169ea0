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


def gpu_formulation(dtype, layout, group, dq, dv=None, softcap=0.0):
    """The GPU modules' formulation (``RAGGED_TILES``) built for llvm-cpu, loaded with its
    capabilities (``paths.Loaded``): ``fwd``, the tiles, the ragged and the packed entry points
    (CUDA's unfused bindings). Compiled once per machine and source: the test processes share the
    modules through ``_shared_vmfb``."""
    from fmha_iree.toolchain.compile import ASYNC_FLAGS, CUDA_FLAGS, compile_flags
    from fmha_iree.codegen.source import fwd_plan, source_mlir
    from fmha_iree.problem.spec import KernelSpec
    from fmha_iree.problem.targets import Target

    spec = KernelSpec(dtype, layout, group, dq, dv or dq, RAGGED_TILES, Target.from_name("host"), softcap=softcap)
    assert fwd_plan(spec, fused_step=True) is not None
    flags = compile_flags(spec) + ASYNC_FLAGS + CUDA_FLAGS + GPU_FORMULATION_CPU_FLAGS
    return bind(_shared_vmfb(source_mlir(spec, fused_step=True), flags), spec)


def bind(vmfb: bytes, spec, *, fused_step: bool = True):
    """``vmfb`` (compiled from ``spec``; ``fused_step``: the GPU formulation) loaded on the CPU with
    its capabilities (``paths.Loaded``), as the paths' functions take it. A build that leaves out
    some entries (``source_mlir(with_fwd=False)``) has the capabilities of those it has."""
    from fmha_iree.codegen.entries import capabilities
    from fmha_iree.paths import Capabilities, Loaded
    from fmha_iree.runtime.module import FmhaModule

    module = FmhaModule(vmfb, "local-task", spec.module_name, typed_bf16=fused_step)
    record = capabilities(spec, fused_step=fused_step)
    names = set(record["entries"]) | {"init", "step", "finalize"}  # a build without fwd keeps the plan
    record = {**record, "entries": sorted(names & module.functions)}
    return Loaded(module, Capabilities.from_record(record, module.functions))


def run_batch(loaded, p, with_lse=True):
    """A checked batch problem's result on ``loaded`` (``paths.run_batch``)."""
    from fmha_iree import paths

    return paths.run_batch(p, with_lse, lambda: loaded)


def route(loaded, p, with_lse=True):
    """A checked batch problem's route on ``loaded`` (``paths.batch_route``)."""
    from fmha_iree import paths

    return paths.batch_route(p, with_lse, lambda: loaded)


def run_group(loaded, p, starts, with_lse=True, memo=None):
    """A checked group-mode problem's result on ``loaded`` (``paths.run_group``)."""
    from fmha_iree import paths

    return paths.run_group(p, starts, with_lse, lambda: loaded, memo)


def run_paged(loaded, q, cache, seqstart_q, *, mask, with_lse=True, scale=None, seqstart_padded_q=None, memo=None):
    """A group-mode problem over a checked paged cache on ``loaded`` (``paths.run_paged``)."""
    from fmha_iree import paths

    prob = paths.paged_problem(q, cache, seqstart_q, seqstart_padded_q, mask=mask, scale=scale, with_lse=with_lse)
    return paths.run_paged(prob, lambda: loaded, memo)


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


def set_policy(monkeypatch, **values):
    """Set thresholds of ``fmha_iree.paths.policy`` for one test (``ROWS_MAX_ROWS=0`` ...): in
    ``policy`` and in every ``fmha_iree`` module that imported them by name (the paths read their
    own copies)."""
    import sys

    from fmha_iree.paths import policy

    for name, value in values.items():
        assert name in policy.__all__, f"policy has no {name}"
        for mod_name, mod in list(sys.modules.items()):
            if mod is not None and mod_name.startswith("fmha_iree") and name in vars(mod):
                monkeypatch.setattr(mod, name, value)


def hide_entries(monkeypatch, *names):
    """Modules the API loads (``api.LOADED``) lack ``names`` in their capabilities for one test,
    as modules built before those entries: the paths that need them refuse."""
    import dataclasses

    from fmha_iree import api

    real = api.LOADED.get

    def get(spec, device_uri):
        loaded = real(spec, device_uri)
        caps = dataclasses.replace(loaded.caps, entries=loaded.caps.entries - set(names))
        return dataclasses.replace(loaded, caps=caps)

    monkeypatch.setattr(api.LOADED, "get", get)


def spy_calls(monkeypatch, *fns):
    """A list that records ``(fn, args, kw)`` of every ``FmhaModule.call`` of the functions ``fns``
    (all where none are given), the calls still made."""
    from fmha_iree.runtime.module import FmhaModule

    seen, real = [], FmhaModule.call

    def call(self, fn, args, **kw):
        if not fns or fn in fns:
            seen.append((fn, args, kw))
        return real(self, fn, args, **kw)

    monkeypatch.setattr(FmhaModule, "call", call)
    return seen
