"""Mask semantics: every CK mask string form over Sq == Sk, Sq < Sk and Sq > Sk.

All on the MAIN kernel key (f32, d64, bhsd, Hq == Hk) except the tile tests, which add two keys
(custom TileConfigs with small tiles, so short lengths cross many tile boundaries).
"""

import pytest
import torch

import fmha_iree
from common import MAIN, check_fwd, len_id
from reference import make_qkv, seed_of

MASKS = [
    "0",
    "t", "1", "b", "2",                       # causal, both spellings
    "t:3,5", "b:3,5",                         # windows
    "t:0,0", "b:0,0",                         # diagonal only
    "t:64,0", "b:0,64",                       # one-sided, crossing a 64/128 tile
    "t:-1,2", "t:4,-1", "b:-1,7", "b:9,-1",   # one unlimited side
    "t:-1,-1", "b:-1,-1",                     # both unlimited == no mask
    "xt:-1", "xb:-1", "xt:0", "xb:0",         # xformers causal (w <= 0, as CK's mask.hpp)
    "xt:5", "xb:6", "xt:200", "xb:129",       # xformers windows (odd / even / wide)
]

# Sq == Sk, Sq < Sk, Sq > Sk; 1 (decode), 7, 77, 130, 300 cross the 128-tile boundaries.
LENGTHS = [(1, 1), (1, 7), (7, 1), (7, 77), (77, 7), (130, 130), (130, 300), (300, 130),
           (300, 300)]


@pytest.mark.parametrize("sq,sk", LENGTHS, ids=[len_id(p) for p in LENGTHS])
@pytest.mark.parametrize("mask", MASKS)
def test_mask_strings(mask, sq, sk):
    q, k, v = make_qkv(seed_of("mask", mask, sq, sk), B=2, Hq=2, Sq=sq, Sk=sk, Dq=MAIN["Dq"],
                       dtype=MAIN["dtype"])
    check_fwd(q, k, v, mask=mask, layout=MAIN["layout"], what=f"mask={mask} {sq}x{sk}")


# Mask objects: the same visibility as the equivalent CK string.
MASK_OBJECTS = [
    ("causal-br", lambda: fmha_iree.Mask.causal(), "b"),
    ("causal-tl", lambda: fmha_iree.Mask.causal(top_left=True), "t"),
    ("window-br", lambda: fmha_iree.Mask.window(5, 2), "b:5,2"),
    ("window-tl", lambda: fmha_iree.Mask.window(5, 2, top_left=True), "t:5,2"),
    ("window-unlim-left", lambda: fmha_iree.Mask.window(-1, 3), "b:-1,3"),
    ("window-unlim-right", lambda: fmha_iree.Mask.window(2, -1, top_left=True), "t:2,-1"),
    ("from_str-xb", lambda: fmha_iree.Mask.from_str("xb:9"), "xb:9"),
    ("from_str-b", lambda: fmha_iree.Mask.from_str("b:64,0"), "b:64,0"),
    ("from_str-0", lambda: fmha_iree.Mask.from_str("0"), "0"),
]


@pytest.mark.parametrize("sq,sk", [(40, 90), (90, 40)], ids=["40x90", "90x40"])
@pytest.mark.parametrize("name,make,ref", MASK_OBJECTS, ids=[m[0] for m in MASK_OBJECTS])
def test_mask_objects(name, make, ref, sq, sk):
    q, k, v = make_qkv(seed_of("maskobj", name, sq, sk), B=1, Hq=2, Sq=sq, Sk=sk,
                       Dq=MAIN["Dq"], dtype=MAIN["dtype"])
    out, lse = check_fwd(q, k, v, mask=make(), ref_mask=ref, what=name)
    # the string spelling runs the same kernel: identical bits
    out_s, lse_s = fmha_iree.fmha_fwd(q, k, v, mask=ref, return_lse=True)
    assert torch.equal(out, out_s) and torch.equal(lse, lse_s)


def test_mask_none_equals_zero_string():
    q, k, v = make_qkv(seed_of("mask-none"), B=1, Hq=2, Sq=33, Sk=65, Dq=MAIN["Dq"])
    out_none, lse_none = check_fwd(q, k, v, mask=None)
    out_0, lse_0 = fmha_iree.fmha_fwd(q, k, v, mask="0", return_lse=True)
    assert torch.equal(out_none, out_0) and torch.equal(lse_none, lse_0)


def test_fully_masked_rows_are_zero_and_neg_inf():
    """'b' with Sq > Sk: the first Sq - Sk rows see no key (out 0, lse -inf, never NaN)."""
    q, k, v = make_qkv(seed_of("fully-masked"), B=2, Hq=2, Sq=200, Sk=70, Dq=MAIN["Dq"])
    out, lse = check_fwd(q, k, v, mask="b")
    assert (out[:, :, :130] == 0).all()
    assert torch.isneginf(lse[:, :, :130]).all()
    assert torch.isfinite(lse[:, :, 130:]).all() and not torch.isnan(out).any()


# Small tiles: the mask is applied at many tile edges and whole tiles are skipped.
TILES = {
    "t32x32x32x64x32": fmha_iree.TileConfig(m0=32, n0=32, k0=32, n1=64, k1=32),
    "t64x16x16x32x16": fmha_iree.TileConfig(m0=64, n0=16, k0=16, n1=32, k1=16),
}
TILE_MASKS = ["0", "t", "b", "t:20,3", "b:0,40", "b:-1,5", "xt:33", "t:0,0"]
TILE_LENGTHS = [(1, 300), (77, 130), (130, 77), (257, 257)]


@pytest.mark.parametrize("sq,sk", TILE_LENGTHS, ids=[len_id(p) for p in TILE_LENGTHS])
@pytest.mark.parametrize("mask", TILE_MASKS)
@pytest.mark.parametrize("tile_name", list(TILES))
def test_masks_with_custom_tiles(tile_name, mask, sq, sk):
    q, k, v = make_qkv(seed_of("tiles", tile_name, mask, sq, sk), B=1, Hq=2, Sq=sq, Sk=sk,
                       Dq=MAIN["Dq"], dtype=MAIN["dtype"])
    check_fwd(q, k, v, mask=mask, tiles=TILES[tile_name], what=f"{tile_name} mask={mask}")


# Window sides as large as a user may type: past every length they mean "unlimited" (they used to
# wrap in the int32 plan descriptors: b:2147483647,0 differed from b by 2.8); a side no 64-bit
# integer holds is refused naming the mask.
@pytest.mark.parametrize("mask", ["b:2147483647,0", "t:2147483648,3", "b:5,99999999999999", "t:4611686018427387904,-1"])
def test_huge_window_sides(mask):
    q, k, v = make_qkv(seed_of("huge", mask), B=1, Hq=2, Sq=130, Sk=77, Dq=MAIN["Dq"], dtype=MAIN["dtype"])
    check_fwd(q, k, v, mask=mask, layout=MAIN["layout"], what=f"mask={mask}")


@pytest.mark.parametrize("mask", [f"b:{2**64},0", f"t:3,{2**63}"])
def test_window_side_past_int64_is_refused(mask):
    q, k, v = make_qkv(seed_of("huge", "bad"), B=1, Hq=2, Sq=7, Sk=7, Dq=MAIN["Dq"], dtype=MAIN["dtype"])
    with pytest.raises(ValueError, match="mask"):
        fmha_iree.fmha_fwd(q, k, v, mask=mask)


@pytest.mark.parametrize("mask", ["0", "b", "t", "b:100,0", "t:3,40", "b:0,0", "xb:9", "t:-1,5", "b:64,64"])
@pytest.mark.parametrize("sq,sk", [(130, 77), (77, 130), (1, 300), (257, 257)], ids=["130x77", "77x130", "1x300", "257x257"])
def test_visible_pairs_counts_the_reference_mask(mask, sq, sk):
    """``Mask.visible_pairs`` (the benchmarks' FLOP count) against the float64 reference's own
    visibility matrix, written from the reference doc."""
    from reference import visible

    assert fmha_iree.Mask.from_str(mask).visible_pairs(sq, sk) == int(visible(mask, sq, sk).sum())
