"""The tile config reaches IREE: kM0 -> workgroup M, kN1 -> workgroup N, kN0 -> reduction over keys.

Compiles the GPU module for gfx942 (no GPU needed) and reads IREE's configured dispatch IR of the
fused online_attention step.
"""

import pytest

import fmha_iree
from fmha_iree.compile import compile_flags, source_mlir
from fmha_iree.spec import KernelSpec
from fmha_iree.targets import Target
from fmha_iree.tiles import default_tiles

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
