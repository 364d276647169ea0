"""``fmha_iree.toolchain.ptx``: the exp2 expansions IREE 3.13 writes into CUDA kernels are all found, what is
removed computes 2^x (run instruction by instruction in float32 here, against float64), and the
patched PTX still assembles (when ``ptxas`` is installed)."""

import shutil
import subprocess

import numpy as np
import pytest

from fmha_iree.codegen.mlir_templates import default_lowering, render_dense_out
from fmha_iree.toolchain.ptx import find_exp2, native_exp2
from fmha_iree.problem.targets import Target


@pytest.fixture(scope="module")
def cuda_ptx(tmp_path_factory):
    """The PTX of a small fused attention (the package's out-only template, sm_80, f16 d64, V
    transposed): IREE's own, one file per executable."""
    import iree.compiler.tools as ict

    low = {**default_lowering("sm_80", dtype="f16", r=64, c=64, dv=64), "transpose_v": True}
    text = "module @ptxcase {\n" + render_dense_out(func_name="f", dtype="f16", layout="bhsd", group=1, dq=64, dv=64,
                                                    align=64, lowering=low, seqlen=256) + "\n}\n"
    d = tmp_path_factory.mktemp("ptx")
    ict.compile_str(text, extra_args=Target.from_name("sm_80").compile_flags() + [
        "--iree-input-type=auto", "--iree-hal-link-executables=false", f"--iree-hal-dump-executable-binaries-to={d}"])
    files = sorted(d.glob("*.ptx"))
    assert files, "IREE dumped no PTX"
    return {f.name: f.read_text() for f in files}


def _f32(bits):
    return np.asarray(bits, np.uint32).view(np.float32)


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def _operand(env, tok, n):
    if tok.startswith("%"):
        return env[tok]
    if tok.startswith("0f"):
        return np.full(n, int(tok[2:], 16), np.uint32)
    return np.full(n, np.int64(int(tok)) & 0xFFFFFFFF, np.uint32)


def _run(lines, x_reg, xs):
    """Execute the expansion's PTX lines on float32 inputs; registers hold 32-bit patterns."""
    env = {x_reg: _bits(xs)}
    n = len(xs)
    last = None
    for ln in lines:
        op, args = ln.strip().rstrip(";").split(None, 1)
        dst, *src = [a.strip() for a in args.split(",")]
        a = [_operand(env, t, n) for t in src]
        if op == "mul.rn.f32":
            r = _bits(_f32(a[0]) * _f32(a[1]))
        elif op == "add.rn.f32":
            r = _bits(_f32(a[0]) + _f32(a[1]))
        elif op == "fma.rn.f32":  # one rounding: the f32 product is exact in f64
            r = _bits((_f32(a[0]).astype(np.float64) * _f32(a[1]) + _f32(a[2])).astype(np.float32))
        elif op in ("setp.lt.f32", "setp.gt.f32"):
            r = (_f32(a[0]) < _f32(a[1])) if op == "setp.lt.f32" else (_f32(a[0]) > _f32(a[1]))
        elif op == "selp.f32":
            r = np.where(a[2], a[0], a[1]).astype(np.uint32)
        elif op == "cvt.rmi.f32.f32":
            r = _bits(np.floor(_f32(a[0])))
        elif op == "cvt.rzi.s32.f32":
            r = np.trunc(_f32(a[0])).astype(np.int32).view(np.uint32)
        elif op == "shl.b32":
            r = (a[0].astype(np.uint64) << a[1].astype(np.uint64)).astype(np.uint32)
        elif op == "add.s32":
            r = (a[0].astype(np.uint64) + a[1].astype(np.uint64)).astype(np.uint32)
        else:
            raise AssertionError(f"unexpected instruction in an exp2 expansion: {ln.strip()}")
        env[dst] = r
        last = dst
    return last, env


def test_every_expansion_is_found_and_computes_exp2(cuda_ptx):
    xs = np.concatenate([np.linspace(-60.0, 0.0, 2401), [-126.0, -1e-3, 0.0, 0.5, 3.25]]).astype(np.float32)
    total = 0
    for name, ptx in cuda_ptx.items():
        sites = find_exp2(ptx)
        # one floor (cvt.rmi) per expansion: every expansion in the file was recognized
        assert len(sites) == ptx.count("cvt.rmi.f32.f32"), name
        lines = ptx.split("\n")
        for s in sites:
            out, env = _run([lines[i] for i in s.lines], s.x, xs)
            assert out == s.out
            got = _f32(env[out]).astype(np.float64)
            want = np.exp2(xs.astype(np.float64))
            ok = want > 1e-30  # below that IREE's clamp flushes to 0 as ex2.approx.ftz does
            # exp2(x) goes through exp(x * ln2) with x * ln2 rounded to f32 first: a relative
            # error up to |x ln2| * 2^-24 (2.5e-6 at x = -60) on top of the polynomial's
            np.testing.assert_allclose(got[ok], want[ok], rtol=5e-6, err_msg=name)
            assert np.all(got[~ok] < 1e-30)
        total += len(sites)
    attention = [n for n in cuda_ptx if "attention" in cuda_ptx[n]]
    assert total > 0 and attention


def test_native_exp2_replaces_them_all(cuda_ptx):
    for name, ptx in cuda_ptx.items():
        n = ptx.count("cvt.rmi.f32.f32")
        text, rep = native_exp2(ptx)
        assert (rep.replaced, rep.floors_left) == (n, 0), name
        assert text.count("ex2.approx.ftz.f32") == ptx.count("ex2.approx.ftz.f32") + n
        assert text.count("mma.sync") == ptx.count("mma.sync")
        if n:
            assert len(text.splitlines()) == len(ptx.splitlines()) - 24 * n


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not installed")
def test_patched_ptx_assembles(cuda_ptx, tmp_path):
    for name, ptx in cuda_ptx.items():
        text, rep = native_exp2(ptx)
        if not rep.replaced:
            continue
        src = tmp_path / name
        src.write_text(text)
        r = subprocess.run(["ptxas", "-arch=sm_80", str(src), "-o", str(tmp_path / "out.cubin")],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("reader", ["\tadd.rn.f32 \t%fake0, {inner}, {inner};", "\tst.global.b32 \t[%rd1], {inner};",
                                    "\t@%p1 add.rn.f32 \t%fake0, {inner}, 0f00000000;",
                                    "\tst.shared.v2.b32 \t[%rd1+8], {{{inner}, {inner}}};"])
def test_expansion_read_elsewhere_is_kept(cuda_ptx, reader):
    """An expansion whose intermediate value is read outside it (by an instruction, a store, a
    predicated instruction, a vector operand) is kept."""
    ptx = next(p for p in cuda_ptx.values() if find_exp2(p))
    sites = find_exp2(ptx)
    lines = ptx.split("\n")
    s = sites[0]
    inner = lines[s.lines[len(s.lines) // 2]].strip().split(None, 1)[1].split(",")[0].strip()
    lines.insert(s.lines[-1] + 1, reader.format(inner=inner))
    assert len(find_exp2("\n".join(lines))) == len(sites) - 1
