"""Deployable modules: the compile matrix, manifests, tiles in IREE's configured IR, ISA reports,
refusals of impossible tiles, and running a module with only the IREE runtime and numpy."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import fmha_iree
from fmha_iree.cli import compile_matrix
from fmha_iree.problem.targets import GFX_TARGETS, Target
from fmha_iree.problem.tiles import not_supported_reasons

from common import configured_attention_tiles
from reference import attention_ref, assert_close

ALL_TARGETS = list(GFX_TARGETS) + ["sm_80", "host"]
DTYPES = ["f16", "bf16", "f32"]
MANIFEST_KEYS = {"format", "abi_version", "module", "problem", "target", "tiles", "entry_points", "toolchain",
                 "flags", "command", "isa", "capabilities", "native_exp2"}


# CI compiles 19 of the full matrix's 90 entries: every target with two or three head dims, one of
# them with the one-call entry points where the target has them (f16 / bf16), each head dim on two
# to four targets, f32 on four, and gfx1100's layouts with Q in shared memory (bf16 d128, f16 d256,
# bf16 d256, the last refused until 2026-12-06). (Every target with
# every head dim, the dtypes rotating, was 42 modules: over half of a 55-minute CI run on a
# 2-core machine, 2026-12-03.) The full matrix is `scripts/compile_matrix.py` (docs/BENCHMARKS.md
# has its last run).
MATRIX = [("gfx90a", 128, "f16"), ("gfx90a", 192, "bf16"),
          ("gfx942", 64, "f16"), ("gfx942", 256, "bf16"), ("gfx942", 96, "f32"),
          ("gfx950", 256, "f16"), ("gfx950", 96, "bf16"),
          ("gfx1100", 256, "bf16"), ("gfx1100", 128, "f16"), ("gfx1100", 64, "f32"),
          ("gfx1100", 128, "bf16"), ("gfx1100", 256, "f16"),
          ("gfx1201", 32, "f16"), ("gfx1201", 192, "bf16"),
          ("sm_80", 128, "f16"), ("sm_80", 96, "bf16"), ("sm_80", 256, "f32"),
          ("host", 64, "f32"), ("host", 32, "f16")]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """Compile the default config of each MATRIX entry (masks are runtime values: one module
    serves every mask kind), two at a time."""
    out = tmp_path_factory.mktemp("matrix")
    rows = []
    for t in ALL_TARGETS:
        for dt in DTYPES:
            hdims = [d for t2, d, dt2 in MATRIX if (t2, dt2) == (t, dt)]
            rows += compile_matrix(out, [t], hdims, [dt], jobs=2, progress=False, keep_dumps=True) if hdims else []
    return out, rows


def test_matrix_compiles_every_default(matrix):
    """Every entry compiles, or is refused before IREE with the reason the target gives."""
    out, rows = matrix
    assert len(rows) == len(MATRIX)
    assert ("gfx1100", 256, "bf16") in MATRIX
    failed = [r for r in rows if not r["ok"] and "refused" not in r]
    assert not failed, failed
    for r in (r for r in rows if "refused" in r):
        t = Target.from_name(r["target"])
        from fmha_iree.problem.tiles import default_tiles

        why = not_supported_reasons(default_tiles(t.family, r["hdim"], r["hdim"], t.arch, r["dtype"]), t.family, t.arch,
                                    r["hdim"], r["hdim"], r["dtype"])
        assert why and all(w in r["refused"] for w in why), r
    refused = [r for r in rows if "refused" in r]
    assert not refused, refused  # gfx1100 bf16 d256 was, until the scale moved onto the scores


@pytest.mark.parametrize("target", ALL_TARGETS)
def test_matrix_manifests_tiles_and_isa(matrix, target):
    out, rows = matrix
    for r in (r for r in rows if r["target"] == Target.from_name(target).arch and r["ok"]):
        man = json.loads((out / f"{r['module']}.json").read_text())
        assert MANIFEST_KEYS <= set(man), set(man) ^ MANIFEST_KEYS
        assert man["problem"]["dtype"] == r["dtype"] and man["problem"]["hdim"] == r["hdim"]
        assert set(man["tiles"]["ck"]) == {"kM0", "kN0", "kK0", "kN1", "kK1"}
        # GPU modules with an explicit lowering over the whole Dv also get the one-call entry points.
        has_dense = man["tiles"]["iree"]["lowering"] is not None and man["tiles"]["ck"]["kN1"] == r["hdim"]
        caps = man["capabilities"]
        assert (caps["dense"] is not None) == has_dense, (r["module"], caps["dense"])
        assert set(caps["entries"]) == set(man["entry_points"]), (r["module"], set(caps["entries"]) ^ set(man["entry_points"]))
        assert caps["formulation"] == ("cpu" if man["target"]["backend"] == "llvm-cpu" else "gpu"), caps
        assert (caps["dtype"], caps["layout"], caps["dq"], caps["dv"]) == (r["dtype"], "bhsd", r["hdim"], r["hdim"])
        # CUDA and gfx9 modules in f16 / bf16 whose tiles keep Dv whole also get fwd (any lengths and
        # mask, kernels.general) and fwd_ragged (sequences of their own lengths in one frame,
        # kernels.ragged), head dims 96 / 192 included (run zero-padded to 128 / 256); RDNA ones
        # at every head dim (gfx1100's d128 tile splits Dv, fwd keeps it whole; 192 / 256 with a
        # layout of their own, lowering.RDNA_D256 / RDNA3_D256)
        fam = man["target"]["family"]
        has_fwd = r["dtype"] != "f32" and (fam in ("cuda", "cdna") and man["tiles"]["ck"]["kN1"] == r["hdim"]
                                          or fam == "rdna")
        # CPU modules get rows / rows_kpad (short queries, any lengths and mask, rows.Rows),
        # step_open (the plan's units that see every key of their chunk, no mask), units (the
        # plan's units looped inside the module, mlir_templates.unit_loop) and waves_varlen
        # (batches of middling lengths as sequences of packed tokens, mlir_templates.unit_waves)
        has_rows = man["target"]["backend"] == "llvm-cpu"
        # modules with fwd also get fwd_tiles (tiles of query rows over their own keys,
        # kernels.tiles) where the head dims are not padded on the way; gfx ones up to head dim
        # 128 but gfx1100 at 64, and at 256 on gfx950 (source._rocm_tiles: where its kernels
        # compiled without spills and its 256-wide steps fit the LDS)
        gfx11_64 = r["target"].startswith("gfx11") and 32 < r["hdim"] < 128
        gfx_tiles = (r["hdim"] <= 128 or r["target"] == "gfx950") and not gfx11_64
        has_tiles = has_fwd and r["hdim"] not in (96, 192) and (fam == "cuda" or gfx_tiles)
        # the host tile plan (init / step / finalize) where no one-call path takes every problem: CPU
        # modules and GPU ones without fwd / fwd_ragged (source.has_plan)
        has_plan = not has_fwd
        assert set(man["entry_points"]) == (({"init", "step", "finalize"} if has_plan else set())
                                            | ({"dense"} if has_dense else set())
                                            | ({"fwd", "fwd_ragged"} if has_fwd else set())
                                            | ({"fwd_tiles"} if has_tiles else set())
                                            | ({"rows", "rows_kpad", "step_open", "units", "waves_varlen"} if has_rows else set()))
        main_entry = "step" if has_plan else "fwd"
        assert "?" in man["entry_points"][main_entry]["args"]["q"][0], "batch / sequence dims must be dynamic"
        assert man["toolchain"]["iree-base-compiler"] and any(f.startswith("--iree-hal-target-device") for f in man["flags"])
        assert (out / f"{r['module']}.vmfb").stat().st_size > 0
        low = man["tiles"]["iree"]["lowering"]
        if low is not None and (has_plan or has_dense):  # the requested tiles reach IREE's configured IR
            # (the ops that carry them: the plan's step and the dense entries; fwd's kernels tile themselves)
            ck = man["tiles"]["ck"]
            found = configured_attention_tiles(out / "dumps" / r["module"])
            assert ([1, ck["kM0"], 0, 0, ck["kN1"]], [0, 0, 0, ck["kN0"], 0]) in found, (r["module"], found)
        if man["target"]["backend"] == "rocm":
            isa = man["isa"]
            assert isa, "gfx manifests carry an ISA report"
            for k in isa:
                assert {"vgpr_count", "agpr_count", "sgpr_count", "vgpr_spill_count", "group_segment_fixed_size",
                        "mfma_count", "wmma_count", "occupancy_waves_per_simd"} <= set(k)
                assert k["vgpr_spill_count"] == 0 and k["sgpr_spill_count"] == 0, (r["module"], k)
            matrix_ops = sum(k["mfma_count"] + k["wmma_count"] for k in isa)
            if low is not None:  # our configs name an MFMA/WMMA intrinsic: it must be in the code
                assert matrix_ops > 0, f"{r['module']}: no MFMA/WMMA instructions"
            if has_fwd:  # every attention op of fwd / fwd_ragged on MFMA, padded head dims included
                ops = [k for k in isa if k["kernel"].startswith("fwd") and "attention" in k["kernel"]]
                assert ops and all(k["mfma_count"] + k["wmma_count"] for k in ops), (r["module"], ops)
            # the plan's step (where the module has it) on MFMA / WMMA too, head dims 96 / 192
            # computed at 128 / 256 (source.step_compute); not f32
            if r["dtype"] != "f32" and has_plan:
                steps = [k for k in isa if k["kernel"].startswith("step") and "attention" in k["kernel"]]
                assert steps and all(k["mfma_count"] + k["wmma_count"] for k in steps), (r["module"], steps)
        else:
            assert man["isa"] is None
        if man["target"]["backend"] == "cuda":  # every exp2 expansion became ex2.approx (fmha_iree/toolchain/ptx.py)
            ex = man["native_exp2"]
            assert ex["replaced"] > 0 and ex["floors_left"] == 0, (r["module"], ex)
            assert (out / f"{r['module']}.vmfb").read_bytes().count(b"ex2.approx.ftz.f32") >= ex["replaced"]
            if r["dtype"] != "f32" and has_plan:  # the plan's step on mma.sync, padded head dims included
                step = [t for n, t in _ptx_entries(out / "dumps" / r["module"]).items()
                        if n.startswith("step") and "attention" in n]
                assert step and all("mma.sync" in t for t in step), r["module"]
            if has_fwd:  # K / V / Q read with vector loads (compile.CUDA_FLAGS), not 16-bit scalars
                ptx = [p for p in (out / "dumps" / r["module"]).glob("*_fwd*.ptx") if "mma.sync" in p.read_text()]
                scalar = {p.name: p.read_text().count("ld.global.nc.b16") for p in ptx}
                assert ptx and not any(scalar.values()), (r["module"], scalar)
                # the copies move 64-bit words and the edge masks are made in blocks, 16 bytes a
                # thread (kernels.elementwise: IREE proves no binding of theirs aligned)
                entries = _ptx_entries(out / "dumps" / r["module"])
                q_copy = [t for n, t in entries.items() if re.fullmatch(r"fwd_dispatch_\d+_\w*_i64", n)]
                assert q_copy and all(re.search(r"ld\.global(\.nc)?\.b64", t) and ".b16" not in t for t in q_copy), r["module"]
                masks = {n: t.count("st.global.b8") for n, t in entries.items() if n.startswith("fwd") and n.endswith("xi1")}
                assert masks and all(c >= 16 for c in masks.values()), (r["module"], masks)
        else:
            assert man["native_exp2"] is None


def _ptx_entries(dump) -> dict:
    """{kernel name: its PTX} of every dumped PTX file of a module."""
    found = {}
    for p in dump.glob("*.ptx"):
        for m in re.finditer(r"\.entry (\w+)\((.*?)\n}", p.read_text(), re.S):
            found[m.group(1)] = m.group(2)
    return found


@pytest.mark.parametrize("target", ["gfx90a", "gfx950", "gfx1201", "sm_80"])
def test_nondefault_tiles_reach_configured_ir(tmp_path, target):
    from fmha_iree.toolchain.compile import build_artifact
    from fmha_iree.problem.spec import KernelSpec

    tiles = fmha_iree.TileConfig(m0=32, n0=32, k0=16, n1=64, k1=16, kv_chunk=128)
    spec = KernelSpec("f16", "bshd", 2, 128, 128, tiles, Target.from_name(target))
    man = build_artifact(spec, tmp_path / "m.vmfb", dump_dir=tmp_path / "dump")
    assert ([1, 32, 0, 0, 64], [0, 0, 0, 32, 0]) in configured_attention_tiles(tmp_path / "dump")
    assert man["tiles"]["iree"]["workgroup"] == [1, 32, 0, 0, 64]


def test_iree_exp2_keeps_iree_ptx(tmp_path):
    """`fmha-iree compile --iree-exp2`: IREE's own PTX (its exp2 polynomial, no ex2.approx)."""
    out = tmp_path / "m.vmfb"
    r = subprocess.run([sys.executable, "-m", "fmha_iree.cli", "compile", "--target", "sm_80", "--dtype", "f16",
                        "--hdim", "64", "--iree-exp2", "-o", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    man = json.loads(out.with_suffix(".json").read_text())
    assert man["native_exp2"] is None
    data = out.read_bytes()
    assert b"ex2.approx.ftz.f32" not in data and b"cvt.rmi.f32.f32" in data


@pytest.mark.parametrize(
    "tiles,fragment",
    [
        (fmha_iree.TileConfig(128, 128, 32, 128, 32), "shared memory"),
        (fmha_iree.TileConfig(72, 64, 16, 128, 16), "multiple of the matrix intrinsic"),
        (fmha_iree.TileConfig(64, 64, 16, 96, 16), "does not divide"),
    ],
)
def test_impossible_tiles_are_refused_before_iree(tiles, fragment):
    before = fmha_iree.cache_stats()["compiles"]
    q = np.zeros((1, 2, 8, 128), np.float16)
    with pytest.raises(ValueError, match="tiles") as e:
        fmha_iree.fmha_fwd(q, q, q, tiles=tiles, device="hip://0")
    assert fragment in str(e.value)
    assert fmha_iree.cache_stats()["compiles"] == before


def test_cli_refuses_impossible_tiles(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fmha_iree.cli", "compile", "--target", "gfx942", "--dtype", "f16",
                        "--hdim", "128", "--tiles", "128x128x32x128x32", "-o", str(tmp_path / "x.vmfb")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "shared memory" in r.stderr
    assert not (tmp_path / "x.vmfb").exists()


@pytest.mark.parametrize("target,extra,fragment", [
    ("sm_80", ["--seqlens", "1000"], "alignment 256"),
    ("host", ["--seqlens", "100"], "multiple of 128"),
    ("gfx1100", ["--seqlens", "1024"], "no one-call entry points"),  # d128 splits Dv there
    ("sm_80", ["--seqlens", "1024", "--batch", "2"], "--batch"),
])
def test_cli_refuses_bad_seqlens(tmp_path, target, extra, fragment):
    """--seqlens / --batch a module cannot take are refused before IREE runs, naming the option."""
    r = subprocess.run([sys.executable, "-m", "fmha_iree.cli", "compile", "--target", target, "--dtype", "f16",
                        "--hdim", "128", *extra, "-o", str(tmp_path / "x.vmfb")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and fragment in r.stderr and ("seqlens" in r.stderr or "batch" in r.stderr), r.stderr
    assert not (tmp_path / "x.vmfb").exists()


# The code generator's wings: importing anything in them fails (a submodule's import goes
# through its package first)
CODEGEN = ("fmha_iree.codegen", "fmha_iree.toolchain", "iree.turbine")


def _route_lines(stdout: str, tag: str) -> list[str]:
    """The lines of ``str(route)`` the subprocess printed between ``<tag>`` and ``</tag>``."""
    text = stdout.split(f"<{tag}>\n", 1)[1].split(f"</{tag}>", 1)[0]
    return text.splitlines()


def test_host_module_runs_with_runtime_only(tmp_path):
    """`fmha-iree compile --target host`, then `fmha_iree.load` in a process where importing torch,
    iree.compiler or any part of the code generator fails; ``route`` explains the batch call there."""
    vmfb = tmp_path / "fmha.vmfb"
    subprocess.run([sys.executable, "-m", "fmha_iree.cli", "compile", "--target", "host", "--dtype", "f32",
                    "--hdim", "64", "--hdim-v", "32", "--heads", "4:2", "--mask", "b", "-o", str(vmfb)],
                   check=True, capture_output=True)
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 4, 37, 64), dtype=np.float32)
    k = rng.standard_normal((2, 2, 50, 64), dtype=np.float32)
    v = rng.standard_normal((2, 2, 50, 32), dtype=np.float32)
    np.save(tmp_path / "q.npy", q), np.save(tmp_path / "k.npy", k), np.save(tmp_path / "v.npy", v)
    code = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None          # import torch -> ImportError
        sys.modules["iree.compiler"] = None  # import iree.compiler -> ImportError
        for m in {CODEGEN!r}:
            sys.modules[m] = None            # the code generator: ImportError too
        import numpy as np
        from fmha_iree import load
        f = load({str(vmfb)!r}, device="local-task")
        d = {str(tmp_path)!r}
        q, k, v = (np.load(f"{{d}}/{{n}}.npy") for n in "qkv")
        r = f.route(q, k, v, return_lse=True)
        print(f"<batch>\\n{{r}}\\n</batch>")
        assert f.capabilities.formulation == "cpu" and f.capabilities.layout == "bhsd"
        out, lse = f(q, k, v, return_lse=True)          # the module's default mask: b
        np.save(f"{{d}}/out.npy", out); np.save(f"{{d}}/lse.npy", lse)
        try:
            f(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16))
        except TypeError as e:
            print("refused:", e)
        assert "torch" not in sys.modules or sys.modules["torch"] is None
        assert all(sys.modules.get(m) is None for m in {CODEGEN!r})
    """)
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert "refused:" in r.stdout and "f32" in r.stdout
    lines = _route_lines(r.stdout, "batch")  # G * Sq = 74 query rows per KV head: rows
    assert lines[0].startswith("batch mode: rows (rows): short queries"), lines
    assert any(line.startswith("  not compiled_in: ") for line in lines[1:]), lines
    out, lse = np.load(tmp_path / "out.npy"), np.load(tmp_path / "lse.npy")
    ref_out, ref_lse = attention_ref(q, k, v, mask="b")
    assert_close(out, ref_out, np.float32, what="deployed out")
    assert_close(lse, ref_lse, np.float32, kind="lse", what="deployed lse")


@pytest.fixture(scope="module")
def bshd_module(tmp_path_factory):
    """A host module compiled with ``--layout bshd`` (f32 d64, heads 4:2, default mask b)."""
    vmfb = tmp_path_factory.mktemp("bshd") / "fmha_thd.vmfb"
    subprocess.run([sys.executable, "-m", "fmha_iree.cli", "compile", "--target", "host", "--dtype", "f32",
                    "--hdim", "64", "--heads", "4:2", "--layout", "bshd", "--mask", "b", "-o", str(vmfb)],
                   check=True, capture_output=True)
    return vmfb


def test_deployed_module_runs_group_mode(bshd_module, tmp_path):
    """A module compiled with `--layout bshd` serves group mode (`DeployedFmha.varlen`) with each
    sequence's own lengths and mask; other layouts and wrong heads are refused before running."""
    import shutil

    from fmha_iree import load
    from reference import varlen_ref

    vmfb = bshd_module
    f = load(vmfb, device="local-task")
    rng = np.random.default_rng(11)
    sq, sk = np.array([0, 5, 5, 38, 101], np.int32), np.array([0, 9, 20, 20, 150], np.int32)
    q = rng.standard_normal((101, 4, 64), dtype=np.float32)
    k = rng.standard_normal((150, 2, 64), dtype=np.float32)
    v = rng.standard_normal((150, 2, 64), dtype=np.float32)
    for mask in (None, "t:3,5", "0"):
        out, lse = f.varlen(q, k, v, sq, sk, mask=mask, return_lse=True)
        ref_out, ref_lse = varlen_ref(q, k, v, sq, sk, mask="b" if mask is None else mask)
        assert_close(out, ref_out, np.float32, what=f"deployed varlen out {mask}")
        assert_close(lse, ref_lse, np.float32, kind="lse", what=f"deployed varlen lse {mask}")
    man = f.manifest
    shutil.copy(vmfb, tmp_path / "as_bhsd.vmfb")
    (tmp_path / "as_bhsd.json").write_text(json.dumps({**man, "problem": {**man["problem"], "layout": "bhsd"}}))
    bhsd = load(tmp_path / "as_bhsd.vmfb", device="local-task")
    with pytest.raises(ValueError, match="layout bshd"):
        bhsd.varlen(q, k, v, sq, sk)
    with pytest.raises(ValueError, match="heads"):
        f.varlen(q[:, :2], k, v, sq, sk)


def _damaged_copies(vmfb, tmp_path):
    """(path, what) pairs: copies of a deployed module, each damaged one way."""
    man = json.loads(vmfb.with_suffix(".json").read_text())
    data = bytearray(vmfb.read_bytes())
    for i in range(1000, len(data), 997):
        data[i] ^= 0xFF
    cases = {"flipped": (bytes(data), man), "truncated": (vmfb.read_bytes()[: len(data) // 2], man),
             # a manifest listing a function the module lacks (the capabilities' entries are what load checks)
             "extra-entry": (vmfb.read_bytes(), {**man, "entry_points": {**man["entry_points"], "causal_s64": {}},
                                                 "capabilities": {**man["capabilities"],
                                                                  "entries": man["capabilities"]["entries"] + ["causal_s64"]}})}
    for what, (blob, m) in cases.items():
        path = tmp_path / f"{what}.vmfb"
        path.write_bytes(blob)
        path.with_suffix(".json").write_text(json.dumps(m))
        yield path, what


def test_damaged_module_files_are_refused(bshd_module, tmp_path):
    """``load`` checks the bytes against the manifest's sha256 and the module's functions against
    its capabilities' entry points before the runtime runs anything (flipped bytes crashed IREE's runtime); the
    handle that runs plans unchecked is not reachable from a deployed module."""
    vmfb = bshd_module
    for path, what in _damaged_copies(vmfb, tmp_path):
        with pytest.raises(ValueError, match="sha256|entry points"):
            fmha_iree.load(path)
    f = fmha_iree.load(vmfb)
    assert not hasattr(f, "module")
    from fmha_iree.runtime import module as runtime_module

    assert "FmhaModule" not in runtime_module.__all__ and "FmhaModule" not in fmha_iree.__all__


def test_module_of_an_earlier_manifest_format_is_refused(tmp_path):
    """A manifest of an earlier format (``fmha_iree.module/1``: a module compiled by an earlier
    fmha_iree, whose functions this one does not call) is refused with a ``ValueError`` naming the
    file and saying to compile it again, before the runtime sees the bytes; a file that is no
    fmha_iree manifest at all is refused too."""
    import hashlib

    from fmha_iree.problem.abi import MANIFEST_FORMAT

    assert MANIFEST_FORMAT != "fmha_iree.module/1"
    blob = b"not a module"
    path = tmp_path / "old.vmfb"
    path.write_bytes(blob)
    args = {n: [[], "i64 scalar"] for n in ("B", "Sq", "y", "x", "khi", "khiu")}
    manifest = {"format": "fmha_iree.module/1", "sha256": hashlib.sha256(blob).hexdigest(), "module": "old",
                "entry_points": {"fwd_ragged": {"args": args}}, "dense": None}
    path.with_suffix(".json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="old.vmfb.*earlier fmha_iree.*compile it again"):
        fmha_iree.load(path)
    path.with_suffix(".json").write_text(json.dumps({"module": "old"}))
    with pytest.raises(ValueError, match="not an fmha_iree module manifest"):
        fmha_iree.load(path)


def test_deployed_module_reads_a_paged_cache(bshd_module):
    """``DeployedFmha.varlen`` takes the paged-cache arguments of ``fmha_fwd_varlen``."""
    from test_paged import _cache, _reference, _table

    f = fmha_iree.load(bshd_module)
    k_cache, v_cache = _cache(21, 8, 16)
    lk = [33, 1, 50]
    bt = _table(22, lk, 16, 8, 5)
    q = torch.randn(6, 4, 64, generator=torch.Generator().manual_seed(23))
    sq = np.array([0, 2, 3, 6], np.int32)
    out, lse = f.varlen(q, k_cache, v_cache, sq, None, seqlen_k=np.array(lk, np.int32), block_table=bt,
                        return_lse=True)
    ref_out, ref_lse = _reference(q, k_cache, v_cache, sq, bt, lk, "b")  # the module's default mask
    assert_close(out, ref_out, torch.float32, what="deployed paged out")
    assert_close(lse, ref_lse, torch.float32, kind="lse", what="deployed paged lse")


def test_group_mode_and_paged_cache_with_runtime_only(bshd_module, tmp_path):
    """Group mode (padded starts, seqlen_k, short and long sequences) and a paged cache through a
    loaded module in a process where importing torch, iree.compiler or any part of the code
    generator fails; ``route`` explains a batch, a group-mode and a paged call there."""
    from reference import varlen_ref
    from test_paged import _cache, _reference, _table

    rng = np.random.default_rng(29)
    sq, sk = np.array([0, 1, 1, 140, 143], np.int32), np.array([0, 300, 305, 445, 450], np.int32)
    used = np.array([290, 0, 140, 5], np.int32)
    q = rng.standard_normal((143, 4, 64), dtype=np.float32)
    k = rng.standard_normal((450, 2, 64), dtype=np.float32)
    v = rng.standard_normal((450, 2, 64), dtype=np.float32)
    k_cache, v_cache = (x.numpy() for x in _cache(31, 8, 16))
    lk = [33, 1, 50]
    bt = np.asarray(_table(32, lk, 16, 8, 5), np.int32)
    qp = rng.standard_normal((6, 4, 64), dtype=np.float32)
    sqp = np.array([0, 2, 3, 6], np.int32)
    arrays = dict(q=q, k=k, v=v, sq=sq, sk=sk, used=used, kc=k_cache, vc=v_cache, bt=bt, qp=qp, sqp=sqp,
                  lk=np.array(lk, np.int32))
    for name, a in arrays.items():
        np.save(tmp_path / f"{name}.npy", a)
    code = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None
        sys.modules["iree.compiler"] = None
        for m in {CODEGEN!r}:
            sys.modules[m] = None
        import numpy as np
        from fmha_iree import load
        d = {str(tmp_path)!r}
        a = {{n: np.load(f"{{d}}/{{n}}.npy") for n in {sorted(arrays)!r}}}
        f = load({str(bshd_module)!r}, device="local-task")
        routes = {{
            "batch": f.route(a["q"][None, :140], a["k"][None, :300], a["v"][None, :300], return_lse=True),
            "group": f.route(a["q"], a["k"], a["v"], seqstart_q=a["sq"], seqstart_k=a["sk"], seqlen_k=a["used"],
                             mask="b", return_lse=True),
            "paged": f.route(a["qp"], a["kc"], a["vc"], seqstart_q=a["sqp"], seqlen_k=a["lk"], block_table=a["bt"],
                             return_lse=True),
        }}
        for tag, r in routes.items():
            print(f"<{{tag}}>\\n{{r}}\\n</{{tag}}>")
        out, lse = f.varlen(a["q"], a["k"], a["v"], a["sq"], a["sk"], seqlen_k=a["used"], mask="b", return_lse=True)
        np.save(f"{{d}}/out.npy", out); np.save(f"{{d}}/lse.npy", lse)
        out, lse = f.varlen(a["qp"], a["kc"], a["vc"], a["sqp"], None, seqlen_k=a["lk"], block_table=a["bt"],
                            return_lse=True)
        np.save(f"{{d}}/pout.npy", out); np.save(f"{{d}}/plse.npy", lse)
        assert sys.modules.get("torch") is None
        assert all(sys.modules.get(m) is None for m in {CODEGEN!r})
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    # a host bshd module: a middling batch and group mode take the CPU's group calls, a paged
    # cache of short sequences rows_packed_pages (the pages read in place)
    batch, group, paged = (_route_lines(r.stdout, tag) for tag in ("batch", "group", "paged"))
    assert batch[0].startswith("batch mode: cpu_group (waves_varlen): "), batch
    assert any(line.startswith("  not compiled_in: ") for line in batch[1:]), batch
    assert group[0].startswith("group mode: cpu_group: "), group
    assert [line.split(":")[0] for line in group[1:]] == ["  not tiles", "  not packed", "  not ragged"], group
    assert paged[0].startswith("paged mode: cpu_pages (rows_packed_pages): "), paged
    assert [line.split(":")[0] for line in paged[1:]] == ["  not tiles", "  not packed", "  not ragged"], paged
    ref_out, ref_lse = varlen_ref(q, k, v, sq, sk, seqlen_k=used, mask="b")
    assert_close(np.load(tmp_path / "out.npy"), ref_out, np.float32, what="runtime-only varlen out")
    assert_close(np.load(tmp_path / "lse.npy"), ref_lse, np.float32, kind="lse", what="runtime-only varlen lse")
    ref_out, ref_lse = _reference(torch.from_numpy(qp), torch.from_numpy(k_cache), torch.from_numpy(v_cache), sqp,
                                  torch.from_numpy(bt), lk, "b")
    assert_close(np.load(tmp_path / "pout.npy"), ref_out, np.float32, what="runtime-only paged out")
    assert_close(np.load(tmp_path / "plse.npy"), ref_lse, np.float32, kind="lse", what="runtime-only paged lse")


def test_info_prints_the_manifest(bshd_module, tmp_path):
    """``fmha-iree info`` summarizes a module from its manifest; a path without one is exit 2."""
    r = subprocess.run([sys.executable, "-m", "fmha_iree.cli", "info", str(bshd_module)], capture_output=True, text=True)
    man = json.loads(bshd_module.with_suffix(".json").read_text())
    assert r.returncode == 0, r.stderr
    assert man["module"] in r.stdout and "llvm-cpu host" in r.stdout and "layout=bshd" in r.stdout
    for name in man["entry_points"]:
        assert f"  {name}(" in r.stdout
    r = subprocess.run([sys.executable, "-m", "fmha_iree.cli", "info", str(tmp_path / "none.vmfb")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "manifest" in r.stderr



def test_iree_run_module_runs_a_cpu_module(tmp_path):
    """Deployment without Python: a CPU module's compiled-in entry run by IREE's own
    ``iree-run-module`` (arguments as the manifest lists them), checked against float64."""
    import shutil

    tool = shutil.which("iree-run-module") or str(Path(sys.executable).with_name("iree-run-module"))
    vmfb = tmp_path / "cpu.vmfb"
    subprocess.run([sys.executable, "-m", "fmha_iree.cli", "compile", "--target", "host", "--dtype", "f32", "--hdim",
                    "64", "--heads", "2:2", "--batch", "1", "--seqlens", "128", "-o", str(vmfb)],
                   check=True, capture_output=True)
    args = json.loads(vmfb.with_suffix(".json").read_text())["entry_points"]["causal_s128"]["args"]
    assert list(args) == ["q", "k", "v", "scale"]
    rng = np.random.default_rng(17)
    qkv = [rng.standard_normal((1, 2, 128, 64), dtype=np.float32) for _ in range(3)]
    for n, x in zip("qkv", qkv):
        np.save(tmp_path / f"{n}.npy", x)
    r = subprocess.run([tool, f"--module={vmfb}", "--device=local-task", "--function=causal_s128",
                        *(f"--input=@{tmp_path / n}.npy" for n in "qkv"), "--input=1xf32=0.125",
                        f"--output=@{tmp_path / 'out.npy'}", f"--output=@{tmp_path / 'lse.npy'}"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    ref_out, ref_lse = attention_ref(*qkv, mask="b", scale=0.125)
    assert_close(np.load(tmp_path / "out.npy"), ref_out, np.float32, what="iree-run-module out")
    assert_close(np.load(tmp_path / "lse.npy"), ref_lse, np.float32, kind="lse", what="iree-run-module lse")


@pytest.mark.parametrize("target,expect", [("host", "i16(bf16 bits)"), ("gfx942", "bf16"), ("sm_80", "bf16")])
def test_manifest_step_argument_types(target, expect):
    """The manifest gives the step's q / k / v the element type the module's step takes: the MLIR
    template reads bf16 typed on GPUs and as its int16 bits on the CPU (whose runtime passes them so).
    GPU modules with ``fwd`` and ``fwd_ragged`` carry no plan (``source.has_plan``): their
    manifest has no step, and the step's record is read where it is written."""
    from fmha_iree.codegen.entries import _Io, _plan_entry_points, entry_points
    from fmha_iree.codegen.source import has_plan
    from fmha_iree.problem.spec import KernelSpec
    from fmha_iree.problem.tiles import default_tiles

    tgt = Target.from_name(target)
    spec = KernelSpec("bf16", "bshd", 4, 128, 128, default_tiles(tgt.family, 128, 128), tgt)
    entries = entry_points(spec)
    assert ("step" in entries) == has_plan(spec) == (target == "host"), sorted(entries)
    step = _plan_entry_points(_Io(spec))["step"]["args"]
    assert [step[n][1] for n in ("q", "k", "v")] == [expect] * 3
    if "step" in entries:
        assert entries["step"]["args"] == step


def test_dispatch_limits_name_what_the_runtime_refuses(tmp_path):
    """A dumped export over IREE's GPU HAL limits (16 bindings, 64 push constants a dispatch: such
    a module compiles and then fails to load) is named; one at the limits is not."""
    from fmha_iree.toolchain.isa import dispatch_limits

    def export(name, n, c):
        binds = ", ".join(['#hal.pipeline.binding<storage_buffer, "ReadOnly|Indirect">'] * n)
        return (f"  hal.executable.export public @{name} ordinal(0) layout(#hal.pipeline.layout<constants = {c}, "
                f"bindings = [{binds}]>) count(%arg0: !hal.device) -> (index, index, index) {{\n")

    (tmp_path / "a.mlir").write_text(export("ok", 16, 64) + export("wide", 19, 2))
    (tmp_path / "b.mlir").write_text(export("pushy", 3, 65))
    assert dispatch_limits(tmp_path) == ["pushy: 3 bindings, 65 constants", "wide: 19 bindings, 2 constants"]


def test_manifest_flags_leave_out_a_temporary_dump(tmp_path, monkeypatch):
    """A gfx build dumps its executables (for the ISA report) into a temporary folder unless given
    one: the manifest's flags and command, how to build the module again, leave that folder out,
    and keep a folder the caller chose."""
    import fmha_iree.toolchain.compile as C
    from fmha_iree.problem.spec import KernelSpec, check_tiles

    seen = []

    def fake_compile(spec, *, extra_flags=None, native_exp2=None):
        seen.append(list(extra_flags or []))
        flags = ["--iree-hal-target-device=hip", *(extra_flags or [])]
        return b"vmfb", {"toolchain": {}, "flags": flags, "command": ["iree-compile", "<module>.mlir", *flags]}

    monkeypatch.setattr(C, "compile_spec", fake_compile)
    t = Target.from_name("gfx942")
    spec = KernelSpec("f16", "bhsd", 1, 64, 64, check_tiles(None, t, 64, 64, "f16"), t)
    man = C.build_artifact(spec, tmp_path / "a.vmfb")
    assert any(f.startswith("--iree-hal-dump-executable-files-to=") for f in seen[0])
    assert not any("dump-executable" in f for f in man["flags"] + man["command"]), man["flags"]
    man = C.build_artifact(spec, tmp_path / "b.vmfb", dump_dir=tmp_path / "dumps")
    assert f"--iree-hal-dump-executable-files-to={tmp_path / 'dumps'}" in man["flags"]


def test_deployed_module_with_softcap_and_sinks(tmp_path):
    """`fmha-iree compile --softcap`: the manifest records the cap, calls get it (another value is
    refused before running), and sinks apply to the deployed module's batch and group calls."""
    from fmha_iree import load
    from reference import varlen_ref

    vmfb = tmp_path / "capped.vmfb"
    subprocess.run([sys.executable, "-m", "fmha_iree.cli", "compile", "--target", "host", "--dtype", "f32",
                    "--hdim", "64", "--heads", "4:2", "--layout", "bshd", "--mask", "b", "--softcap", "3",
                    "-o", str(vmfb)], check=True, capture_output=True)
    f = load(vmfb)
    assert f.manifest["variants"] == {"softcap": 3.0, "sinks": True, "sink_tokens": True, "alibi": False,
                                      "bias": False, "fp8_kv": "dequantized"} and f.softcap == 3.0
    rng = np.random.default_rng(5)
    sinks = rng.standard_normal(4).astype(np.float32)
    q = 3 * rng.standard_normal((2, 9, 4, 64), dtype=np.float32)
    k = rng.standard_normal((2, 6, 2, 64), dtype=np.float32)
    v = rng.standard_normal((2, 6, 2, 64), dtype=np.float32)
    out, lse = f(q, k, v, return_lse=True, sinks=sinks, softcap=3.0)
    ref_out, ref_lse = attention_ref(q, k, v, mask="b", layout="bshd", softcap=3.0, sinks=sinks)
    assert_close(out, ref_out, np.float32, what="deployed softcap + sinks")
    assert_close(lse, ref_lse, np.float32, kind="lse", what="deployed softcap + sinks")
    sq, sk = np.array([0, 3, 3, 10], np.int32), np.array([0, 8, 12, 12], np.int32)
    qv, kv, vv = q.reshape(18, 4, 64)[:10], k.reshape(12, 2, 64), v.reshape(12, 2, 64)
    out, lse = f.varlen(qv, kv, vv, sq, sk, return_lse=True, sinks=sinks)
    ref_out, ref_lse = varlen_ref(qv, kv, vv, sq, sk, mask="b", softcap=3.0, sinks=sinks)
    assert_close(out, ref_out, np.float32, what="deployed group")
    assert_close(lse, ref_lse, np.float32, kind="lse", what="deployed group")
    with pytest.raises(ValueError, match="compiled with softcap=3.0"):
        f(q, k, v, softcap=50.0)
    # sink tokens beside a window (paths.sink_tokens) on the deployed module's batch and group calls
    out = f(q, k, v, mask="b:2,0,2", sinks=sinks)
    assert_close(out, attention_ref(q, k, v, mask="b:2,0,2", layout="bshd", softcap=3.0, sinks=sinks)[0], np.float32,
                 what="deployed sink tokens")
    out, lse = f.varlen(qv, kv, vv, sq, sk, mask="b:1,0,2", return_lse=True)
    ref_out, ref_lse = varlen_ref(qv, kv, vv, sq, sk, mask="b:1,0,2", softcap=3.0)
    assert_close(out, ref_out, np.float32, what="deployed group sink tokens")
    assert_close(lse, ref_lse, np.float32, kind="lse", what="deployed group sink tokens")
