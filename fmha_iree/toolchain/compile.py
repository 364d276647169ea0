"""Compile a kernel specialization to an IREE module, with an in-memory and an on-disk cache.

The disk cache (``cache.DiskCache``: where it lives, how entries are checked and protected) is
namespaced by a fingerprint of this package's source and the toolchain versions (iree-base-compiler,
iree-turbine, torch); keys add the spec, the flags and, for ``host`` CPU targets, the host CPU.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import threading
import time
import warnings
from pathlib import Path

from .cache import DiskCache, atomic_write, cache_root
from ..codegen.entries import entry_points
from ..codegen.source import _iree_tiles, native_exp2_default, source_mlir
from ..problem.spec import KernelSpec

__all__ = ["compile_flags", "compile_spec", "get_vmfb", "build_artifact", "cache_dir", "stats", "toolchain",
           "COMPILED", "CompiledModules", "clear_memory_cache"]

_PKG = Path(__file__).resolve().parents[1]
_LOG = logging.getLogger("fmha_iree")


class CompiledModules:
    """This process's compiled modules by cache key (bytes, in front of the disk cache) and its
    counters: ``compiles``, ``disk_hits``, ``memory_hits``."""

    def __init__(self):
        self.lock = threading.Lock()
        self.memory: dict[str, bytes] = {}
        self.counts = {"compiles": 0, "disk_hits": 0, "memory_hits": 0}

    def count(self, what: str):
        with self.lock:
            self.counts[what] += 1

    def get(self, key: str) -> bytes | None:
        with self.lock:
            vmfb = self.memory.get(key)
            if vmfb is not None:
                self.counts["memory_hits"] += 1
            return vmfb

    def put(self, key: str, vmfb: bytes):
        with self.lock:
            self.memory[key] = vmfb

    def clear(self):
        with self.lock:
            self.memory.clear()


COMPILED = CompiledModules()


def stats() -> dict:
    """Counters of this process: ``compiles`` (modules built), ``disk_hits``, ``memory_hits``."""
    with COMPILED.lock:
        return dict(COMPILED.counts)


@functools.lru_cache(maxsize=None)
def toolchain() -> dict:
    """Versions of everything that shapes a compiled module."""
    from importlib import metadata

    out = {}
    for dist in ("iree-base-compiler", "iree-turbine", "torch"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


@functools.lru_cache(maxsize=None)
def _host_cpu() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return hashlib.sha256("\n".join(sorted(set(lines))).encode()).hexdigest()[:16]


# The package's wings whose files shape a compiled module (tests/test_layers.py: the compile
# imports nothing else but the runtime's device arrays, which generate no code); editing any
# other file keeps the disk cache.
SHAPES_MODULES = frozenset({"problem", "codegen", "toolchain"})


@functools.lru_cache(maxsize=None)
def source_fingerprint() -> str:
    """A digest of every package file that shapes a compiled module (``SHAPES_MODULES``) and of
    the toolchain."""
    h = hashlib.sha256()
    for p in sorted(_PKG.rglob("*")):
        top = p.relative_to(_PKG).parts[0]
        if p.is_file() and p.suffix in (".py", ".mlir", ".in", ".json") and top in SHAPES_MODULES:
            h.update(str(p.relative_to(_PKG)).encode())
            h.update(p.read_bytes())
    h.update(json.dumps(toolchain(), sort_keys=True).encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    return cache_root() / source_fingerprint()


# llvm-cpu: a step call measured faster on the dev CPU, results within 1e-7 and NaN rows still NaN
# (tests/test_api.py; docs/BENCHMARKS.md, "CPU: the 2-core x86_64 development machine").
_CPU_FLAGS = ["--iree-llvmcpu-reassociate-fp-reductions", "--iree-llvmcpu-use-fast-min-max-ops",
              "--iree-llvmcpu-fail-on-large-vector=false", "--iree-global-opt-enable-attention-v-transpose=false"]


# GPU modules: every function takes a wait and a signal fence and returns at once
# (runtime.FmhaModule chains them), so consecutive calls queue on the device without a host round
# trip: much faster per call on the H200 (docs/tried.md, "IREE's CUDA runtime flags against idle GPU
# between calls").
ASYNC_FLAGS = ["--iree-execution-model=async-external"]

# CUDA: every dispatch binding keeps its own buffer (offset applied by the HAL) instead of IREE's
# fused bindings, which pass a suballocation's offset as a push constant of unknown alignment.
# A dispatch shared by call sites reading K / V in place and call sites reading a packed copy
# (fwd_ragged's frames, the padded path's copies) then read every K / V / Q element with a scalar
# 16-bit load: NVPTX cannot prove the 16-byte alignment of a vector load (iree-compile 3.13,
# sm_80; fwd's interior and split-KV ops, every fwd_ragged op: 32-320 `ld.global.nc.b16` per key
# step, 4 `ld.global.nc.v4.b32` with this flag). ROCm keeps the fusion: its loads are vectors
# either way, and without it gfx90a's GQA kernels spill more scalar registers (bf16 d128 G=4;
# docs/BENCHMARKS.md, "How the constants were chosen").
CUDA_FLAGS = ["--iree-scheduling-optimize-bindings=false"]


def compile_flags(spec: KernelSpec) -> list[str]:
    """Every iree-compile flag used for ``spec`` (target selection first)."""
    extra = _CPU_FLAGS if spec.target.backend == "llvm-cpu" else ASYNC_FLAGS
    if spec.target.backend == "cuda" or (spec.tiles_only and spec.target.backend == "llvm-cpu"):
        # the GPU formulation on the CPU (ALiBi and bias modules) as the tests build it (tests/common.py)
        extra = extra + CUDA_FLAGS + (ASYNC_FLAGS if spec.target.backend == "llvm-cpu" else [])
    return spec.target.compile_flags() + ["--iree-input-type=auto"] + extra


def _cache_key(spec: KernelSpec, flags: list[str]) -> str:
    blob = json.dumps({"spec": spec.as_dict(), "flags": flags, "native_exp2": native_exp2_default(spec)}, sort_keys=True)
    if spec.target.arch == "host":
        blob += _host_cpu()
    return spec.module_name + "-" + hashlib.sha256(blob.encode()).hexdigest()[:12]


def compile_spec(spec: KernelSpec, *, extra_flags: list[str] | None = None,
                 native_exp2: bool | None = None) -> tuple[bytes, dict]:
    """Compile ``spec`` now (no cache). Returns the vmfb and a record of how it was built.

    ``native_exp2`` (CUDA only; default ``native_exp2_default``): compile once with every
    executable's PTX dumped, replace IREE's polynomial exp2 with ``ex2.approx.ftz.f32``
    (``ptx.native_exp2``), and compile again with the patched PTX substituted
    (``--iree-hal-substitute-executable-objects-from``)."""
    import iree.compiler.tools as ict

    t0 = time.perf_counter()
    _LOG.info("compiling %s for %s %s", spec.module_name, spec.target.backend, spec.target.arch)
    flags = compile_flags(spec) + list(extra_flags or [])
    mlir = source_mlir(spec)
    exp2 = native_exp2_default(spec) if native_exp2 is None else bool(native_exp2)
    if exp2 and spec.target.backend != "cuda":
        raise ValueError("native_exp2 applies to CUDA targets only")
    record = {
        "module": spec.module_name,
        "spec": spec.as_dict(),
        "toolchain": toolchain(),
        "command": ["iree-compile", "<module>.mlir", *flags, "-o", "<module>.vmfb"],
        "flags": flags,
    }
    if exp2:
        vmfb, record["native_exp2"] = compile_native_exp2(mlir, flags)
        record["command"] = ["iree-compile", "<module>.mlir", *flags, "--iree-hal-link-executables=false",
                             "--iree-hal-dump-executable-binaries-to=<ptx>", "-o", "/dev/null", "&&",
                             "python", "-m", "fmha_iree.toolchain.ptx", "<ptx>", "<patched>", "&&",
                             *record["command"][:-2], "--iree-hal-substitute-executable-objects-from=<patched>",
                             "-o", "<module>.vmfb"]
    else:
        vmfb = ict.compile_str(mlir, extra_args=flags)
    COMPILED.count("compiles")
    _LOG.info("compiled %s in %.1f s (%d bytes)", spec.module_name, time.perf_counter() - t0, len(vmfb))
    return vmfb, record


def _compile_quiet(mlir: str, flags: list[str], out: Path) -> bytes:
    """iree-compile without echoing its per-executable "NOTE: ... substituted" lines (one per
    patched executable); anything else it prints is logged as a warning."""
    import subprocess

    from iree.compiler.tools.binaries import find_tool

    r = subprocess.run([find_tool("iree-compile"), "-", *flags, "-o", str(out)], input=mlir.encode(),
                       capture_output=True)
    rest = "\n".join(ln for ln in r.stderr.decode(errors="replace").splitlines()
                      if not ln.startswith("NOTE: hal.executable"))
    if r.returncode:
        raise RuntimeError(f"iree-compile failed ({r.returncode}):\n{rest[-4000:]}")
    if rest.strip():
        _LOG.warning("iree-compile: %s", rest)
    return out.read_bytes()


def compile_native_exp2(mlir: str, flags: list[str]) -> tuple[bytes, dict]:
    """Compile ``mlir`` with ``flags`` for CUDA, IREE's polynomial exp2 replaced by
    ``ex2.approx`` (``ptx.patch_dir``): (vmfb, the patch report)."""
    import tempfile

    import iree.compiler.tools as ict

    from .ptx import patch_dir

    with tempfile.TemporaryDirectory(prefix="fmha_iree_ptx_") as tmp:
        raw, patched = Path(tmp) / "ptx", Path(tmp) / "patched"
        ict.compile_str(mlir, extra_args=flags + ["--iree-hal-link-executables=false",
                                                   f"--iree-hal-dump-executable-binaries-to={raw}"])
        report = patch_dir(raw, patched)
        extra = [f"--iree-hal-substitute-executable-objects-from={patched}"] if report["executables_patched"] else []
        vmfb = _compile_quiet(mlir, flags + extra, Path(tmp) / "out.vmfb")
    found = vmfb.count(b"ex2.approx.ftz.f32")
    if found < report["replaced"]:
        raise RuntimeError(f"native_exp2: {report['replaced']} exp2 patched but {found} in the module "
                           "(IREE did not substitute the patched PTX)")
    return vmfb, report


def get_vmfb(spec: KernelSpec) -> bytes:
    """The compiled module for ``spec``: from memory, else the disk cache, else compiled (and
    stored there when the cache can be used; else kept in memory, with a warning)."""
    flags = compile_flags(spec)
    key = _cache_key(spec, flags)
    vmfb = COMPILED.get(key)
    if vmfb is not None:
        return vmfb
    disk = DiskCache(cache_dir())
    why = disk.problem()
    vmfb = None
    if why is not None and disk.readable():
        vmfb = disk.load(key, spec.as_dict())  # a read-only cache still serves what it holds
        if vmfb is not None:
            COMPILED.count("disk_hits")
            why = None
    elif why is None:
        try:
            with disk.lock(key):
                vmfb = disk.load(key, spec.as_dict())
                if vmfb is not None:
                    COMPILED.count("disk_hits")
                else:
                    vmfb, record = compile_spec(spec)
                    disk.store(key, vmfb, record)
        except OSError as e:  # read-only or vanished cache folder: keep what was compiled
            why = f"{disk.folder}: {e}"
    if why is not None:
        warnings.warn(f"fmha_iree: not using the disk cache ({why}); compiled modules stay in memory",
                      RuntimeWarning, stacklevel=2)
        if vmfb is None:
            vmfb, _ = compile_spec(spec)
    COMPILED.put(key, vmfb)
    return vmfb


def clear_memory_cache():
    """Forget in-memory modules (the disk cache stays)."""
    COMPILED.clear()


def build_artifact(spec: KernelSpec, out_path: str | Path, *, dump_dir: str | Path | None = None,
                   problem: dict | None = None, native_exp2: bool | None = None) -> dict:
    """Compile ``spec`` to ``out_path`` (.vmfb) with a JSON manifest beside it; return the manifest.

    For gfx targets the executables are dumped (to ``dump_dir`` or a temp dir) and the manifest gets
    an ISA report (registers, spills, LDS, matrix instructions, occupancy). A dumped GPU module with a
    dispatch the runtime would refuse to load (``isa.dispatch_limits``) is a RuntimeError.
    """
    import tempfile

    from ..problem.abi import ABI_VERSION, MANIFEST_FORMAT
    from ..codegen.entries import capabilities
    from .isa import MAX_BINDINGS, MAX_CONSTANTS, dispatch_limits, isa_report

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(dump_dir) if dump_dir else Path(tmp)
        dump.mkdir(parents=True, exist_ok=True)
        # executables are dumped where they are read (gfx ISA reports) or asked for: on the host
        # IREE then only remarks that it generated no executable benchmarks
        dumped = bool(dump_dir) or spec.target.backend == "rocm"
        dump_flag = f"--iree-hal-dump-executable-files-to={dump}"
        vmfb, record = compile_spec(spec, extra_flags=[dump_flag] if dumped else [], native_exp2=native_exp2)
        if not dump_dir:  # a temporary folder, gone after the build: no part of how to build the module again
            record = {**record, "flags": [f for f in record["flags"] if f != dump_flag],
                      "command": [c for c in record["command"] if c != dump_flag]}
        isa = isa_report(dump, spec.target.arch) if spec.target.backend == "rocm" else None
        # checked where the executables are dumped (gfx, or asked for): a dump also points the
        # module's debug locations at the dumped files, so CUDA builds without --dump stay as they were
        over = dispatch_limits(dump) if dumped and spec.target.backend in ("cuda", "rocm") else []
    if over:
        raise RuntimeError(f"{spec.module_name}: IREE's GPU runtime would refuse to load it (at most {MAX_BINDINGS} "
                           f"bindings and {MAX_CONSTANTS} constants a dispatch): {'; '.join(over[:4])}")
    t = spec.tiles
    manifest = {
        "format": MANIFEST_FORMAT,
        "abi_version": ABI_VERSION,
        "sha256": hashlib.sha256(vmfb).hexdigest(),
        "module": spec.module_name,
        "problem": {"dtype": spec.dtype, "layout": spec.layout, "group": spec.group, "hdim": spec.dq,
                    "hdim_v": spec.dv, **(problem or {})},
        # the score variants: the cap is the module's constant (None: no cap); sinks and sink
        # tokens apply to any module's results (paths.sinks, paths.sink_tokens); fp8 K / V are
        # dequantized before any module (problem.fp8): no fp8 kernel
        "variants": {"softcap": spec.softcap or None, "sinks": True, "sink_tokens": True, "alibi": spec.alibi,
                     "bias": spec.bias, "fp8_kv": "dequantized"},
        "target": {"name": spec.target.arch, "backend": spec.target.backend, "family": spec.target.family},
        "tiles": {"ck": {"kM0": t.m0, "kN0": t.n0, "kK0": t.k0, "kN1": t.n1, "kK1": t.k1}, "kv_chunk": t.kv_chunk,
                  "iree": _iree_tiles(spec)},
        "entry_points": entry_points(spec),
        "capabilities": capabilities(spec),
        "toolchain": record["toolchain"],
        "flags": record["flags"],
        "command": record["command"],
        "native_exp2": record.get("native_exp2"),
        "isa": isa,
    }
    atomic_write(out_path, vmfb)
    atomic_write(out_path.with_suffix(".json"), json.dumps(manifest, indent=2).encode())
    return manifest
