"""The tile config reaches IREE: kM0 -> workgroup M, kN1 -> workgroup N, kN0 -> reduction over keys.

Compiles the GPU module for gfx942 (no GPU needed) and reads IREE's configured dispatch IR of the
fused online_attention step.
"""

import pytest

import fmha_iree
from fmha_iree.toolchain.compile import compile_flags
from fmha_iree.codegen.source import source_mlir
from fmha_iree.problem.spec import KernelSpec
from fmha_iree.problem.targets import Target
from fmha_iree.problem.tiles import default_tiles

from common import configured_attention_tiles


def _configured_tiles(tmp_path, spec):
    import iree.compiler.tools as ict

    ict.compile_str(source_mlir(spec), extra_args=compile_flags(spec) + [f"--iree-hal-dump-executable-files-to={tmp_path}"])
    return configured_attention_tiles(tmp_path)


@pytest.mark.parametrize(
    "tiles",
    [fmha_iree.TileConfig(m0=64, n0=32, k0=16, n1=128, k1=16, kv_chunk=256), None],
    ids=["64x32x16x128x16", "default"],
)
def test_gfx942_configured_ir_shows_requested_tiles(tmp_path, tiles):
    target = Target.from_name("gfx942")
    tiles = tiles or default_tiles(target.family, 128, 128, target.arch)
    spec = KernelSpec("f16", "bhsd", 1, 128, 128, tiles, target)
    found = _configured_tiles(tmp_path, spec)
    assert found, "no configured online_attention dispatch found"
    # Dims of the op are (batch, M, K1, K2, N).
    assert ([1, tiles.m0, 0, 0, tiles.n1], [0, 0, 0, tiles.n0, 0]) in found, found


def _configured_executables(spec, text: str) -> str:
    """IREE's configured executables of one rendered function (the module's only one)."""
    import iree.compiler.tools as ict

    out = ict.compile_str("module @m {\n" + text + "\n}\n",
                          extra_args=compile_flags(spec) + ["--compile-to=executable-configurations"])
    return out.decode() if isinstance(out, bytes) else out


def _fwd_ops(text: str, func: str = "fwd"):
    """(workgroup rows, workgroup size, subgroups along Dv, has a mask, keys per step) of each
    attention op of ``func`` in rendered module text."""
    import re

    body = text[text.index(f"@{func}("):]
    body = body[:body.index("\n  func.func", 1)] if "\n  func.func" in body[1:] else body
    for op in body.split("iree_linalg_ext.online_attention")[1:]:
        op = op[:op.index("^bb0")]
        wg = [int(x) for x in re.search(r"workgroup = \[([^\]]*)\]", op).group(1).split(",")]
        size = int(re.search(r"workgroup_size = \[(\d+)", op).group(1))
        basis = re.search(r"subgroup_basis = \[\[([^\]]*)\]", op).group(1).split(",")
        k2 = int(re.search(r"reduction = \[([^\]]*)\]", op).group(1).split(",")[-2])
        ins = re.search(r"ins\([^:]*:([^)]*)\)", op).group(1)
        # workgroup = [1 per batch dim, M, 0 per reduction dim (two key dims over pages), N]
        yield max(wg[:-1]), size, int(basis[-1]), bool(re.search(r"xi(1|8)>", ins)), k2


@pytest.mark.parametrize("arch,rows,all_split", [("gfx1201", 64, False), ("gfx1100", 32, True)])
def test_rdna_fwd_splits_dv_in_masked_ops(arch, rows, all_split):
    """RDNA modules carry ``fwd``; its masked ops (and on gfx1100 d128 all its ops, whose default
    tile would split Dv across workgroups) run two subgroups along Dv in one workgroup (the layout
    that compiled without VGPR spills, ``mlir_templates.lowering.rdna_fwd_lowering``); the rest keep one."""
    t = Target.from_name(arch)
    spec = KernelSpec("f16", "bhsd", 1, 128, 128, default_tiles(t.family, 128, 128, t.arch, "f16"), t)
    ops = [o for o in _fwd_ops(source_mlir(spec, with_ragged=False)) if o[0] == rows]
    assert any(o[3] for o in ops) and not all(o[3] for o in ops), ops
    for _, size, split, masked, _ in ops:
        want = 2 if (masked or all_split) else 1
        assert (split, size) == (want, 32 * rows // 16 * want), (arch, masked, split, size)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_gfx1100_d128_q_in_shared_memory(dtype):
    """gfx1100 bf16 d128 stages Q in shared memory in every ``fwd`` op and takes 16-key steps in
    the short tier's masked ops (the layout that compiled without spills,
    ``mlir_templates.lowering._RDNA_SPLIT_ALL``); f16 keeps Q in registers."""
    import re

    t = Target.from_name("gfx1100")
    spec = KernelSpec(dtype, "bshd", 4, 128, 128, default_tiles(t.family, 128, 128, t.arch, dtype), t)
    text = source_mlir(spec, with_ragged=False)
    fwd = text[text.index("@fwd("):]
    qk = re.findall(r"attention_qk_matmul, lowering_config = [^}]*promote_operands = \[([\d, ]*)\]", fwd)
    assert qk and set(qk) == {"0, 1" if dtype == "bf16" else "1"}, set(qk)
    short = [o for o in _fwd_ops(text) if o[0] == 16]
    assert short and any(o[3] for o in short), short
    for _, _, _, masked, k2 in short:
        assert k2 == (16 if masked and dtype == "bf16" else 32), short


@pytest.mark.parametrize("arch,dtype,hdim", [("gfx1201", "bf16", 256), ("gfx1201", "bf16", 192),
                                             ("gfx1100", "f16", 256), ("gfx1100", "f16", 192), ("gfx1100", "bf16", 256)])
def test_rdna_fwd_at_dv_256(arch, dtype, hdim):
    """At Dv 256 (192 computes at 256) RDNA modules carry ``fwd`` with a layout of its own:
    16 rows, four subgroups along Dv, 32-key steps and 16 in masked ops
    (``mlir_templates.lowering.RDNA_D256``, the layout that compiled without spills); on gfx11
    Q is staged in shared memory in every op and the short tier's ops run sixteen subgroups
    along Dv (``RDNA3_D256``), and in bf16 its masked main-tier ops eight."""
    import re

    t = Target.from_name(arch)
    spec = KernelSpec(dtype, "bshd", 4, hdim, hdim, default_tiles(t.family, hdim, hdim, t.arch, dtype), t)
    text = source_mlir(spec, with_ragged=False)
    ops = list(_fwd_ops(text))
    assert ops and any(o[3] for o in ops)
    gfx11 = arch == "gfx1100"
    splits = (4, 8, 16) if (gfx11 and dtype == "bf16") else (4, 16) if gfx11 else (4,)
    for rows, size, split, masked, k2 in ops:
        assert rows == 16 and size == 32 * split and split in splits, (rows, size, split, masked)
        assert k2 == 16 if masked else k2 in (16, 32), (masked, k2)  # unmasked: the main tier 32, split-KV 16
    assert 32 in [o[4] for o in ops], ops
    assert (16 in [o[2] for o in ops]) == gfx11, ops  # gfx11's short tier
    fwd = text[text.index("@fwd("):]
    qk = re.findall(r"attention_qk_matmul, lowering_config = [^}]*promote_operands = \[([\d, ]*)\]", fwd)
    assert qk and set(qk) == {"0, 1" if gfx11 else "1"}, set(qk)


@pytest.mark.parametrize("dtype,hdim,edge_rows,edge_warps", [("f16", 128, 64, 4), ("bf16", 128, 64, 4),
                                                             ("f16", 64, 128, 4), ("f16", 256, 128, 8)])
def test_cuda_tiles_edge_subgroups(dtype, hdim, edge_rows, edge_warps):
    """``fwd_tiles`` on CUDA: the interior op keeps 128 rows at 32 rows a warp (Dv 256: 16); the
    masked edge op takes one warp per 16 rows from Dv 128, and half a tile's rows
    (``EDGE_PARTS``) where that keeps the interior's warps (``tiles._gpu_edge``)."""
    from fmha_iree.codegen.kernels.tiles import render_tiles
    from fmha_iree.codegen.source import fwd_plan

    t = Target.from_name("sm_80")
    spec = KernelSpec(dtype, "bshd", 1, hdim, hdim, default_tiles(t.family, hdim, hdim, t.arch, dtype), t)
    ops = [(masked, rows, size) for rows, size, _, masked, _ in _fwd_ops(render_tiles(fwd_plan(spec)), "fwd_tiles")]
    interior = 256 if hdim == 256 else 128
    assert sorted(ops) == [(False, 128, interior), (True, edge_rows, 32 * edge_warps)], ops


@pytest.mark.parametrize("arch,dtype,hdim,has", [
    ("gfx90a", "f16", 128, True), ("gfx942", "bf16", 64, True), ("gfx950", "f16", 32, True),
    ("gfx1100", "bf16", 128, True), ("gfx1100", "f16", 64, False), ("gfx1100", "f16", 32, True),
    ("gfx1201", "bf16", 128, True), ("gfx942", "f16", 256, False), ("gfx1201", "f16", 256, False),
    ("gfx950", "bf16", 256, True), ("gfx942", "f16", 96, False)])
def test_gfx_tiles_where_they_compiled_clean(arch, dtype, hdim, has):
    """gfx modules carry ``fwd_tiles`` up to head dim 128 but gfx1100 at 64, and at 256 where the LDS
    holds its steps (gfx950) (``source._rocm_tiles``: where its kernels compiled without spills),
    not where the head dims are padded. Where they carry it, both ops render with a lowering whose
    workgroup size matches its subgroups (RDNA's split Dv included)."""
    from fmha_iree.codegen.kernels.tiles import render_tiles, tiles_shape
    from fmha_iree.codegen.source import fwd_plan

    t = Target.from_name(arch)
    spec = KernelSpec(dtype, "bshd", 4, hdim, hdim, default_tiles(t.family, hdim, hdim, t.arch, dtype), t)
    plan = fwd_plan(spec)
    assert (plan is not None and tiles_shape(plan) is not None) == has
    if has:
        ops = list(_fwd_ops(render_tiles(plan), "fwd_tiles"))
        assert sorted(masked for *_, masked, _ in ops) == [False, True], ops


@pytest.mark.parametrize("arch,dtype,hdim,computed,intrinsic", [
    ("gfx942", "bf16", 96, 128, "MFMA"), ("gfx90a", "f16", 192, 256, "MFMA"), ("gfx1100", "f16", 96, 128, "WMMA"),
    ("sm_80", "f16", 96, 128, "NV_MMA_SYNC"), ("gfx1201", "f16", 192, 256, None), ("gfx1100", "bf16", 192, 256, "WMMA"),
    ("gfx942", "f32", 96, 96, None)])
def test_step_computes_padded_head_dims(arch, dtype, hdim, computed, intrinsic):
    """The plan's ``step`` computes head dims 96 / 192 zero-padded to 128 / 256 with the matrix
    intrinsic of those (IREE's own config at 96 / 192 has none; gfx1201 at 256 keeps IREE's own,
    which has WMMA); f32 stays at its own dims."""
    import re

    t = Target.from_name(arch)
    spec = KernelSpec(dtype, "bshd", 2, hdim, hdim, default_tiles(t.family, hdim, hdim, t.arch, dtype), t)
    text = source_mlir(spec, with_fwd=False)
    step = text[text.index("@step("):]
    op = step[step.index("iree_linalg_ext.online_attention"):]
    op = op[:op.index("^bb0")]
    q_type = re.search(r"ins\([^:]*:\s*tensor<\?x\d+x(\d+)x", op)
    assert int(q_type.group(1)) == computed, op
    kind = re.search(r"mma_kind = #iree_gpu\.(?:virtual_)?mma_layout<(\w+)>", op)
    if intrinsic is None:  # IREE picks the config
        assert kind is None, op
    else:
        assert kind and kind.group(1).startswith(intrinsic), op
