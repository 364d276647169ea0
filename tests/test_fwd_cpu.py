"""``fwd`` (``fmha_iree.codegen.kernels.general``: any lengths and any CK mask in one call) checked for
numbers on the CPU, where CI runs: the GPU module's formulation built for llvm-cpu and driven
through the batch-mode paths (``paths.run_batch``), against the float64 reference.

Covered: tails that are not multiples of any tile (1..127 rows / keys), Sq < Sk and Sq > Sk under
every mask kind, rows that see no key (out 0, lse -inf), Sq = 1 against up to 8192 keys (the
short-query tier and split-KV), several groups of rows (one live, several live, dead ones), GQA /
MQA, both layouts, f32 / f16 / bf16, and LSE."""

import numpy as np
import pytest
import torch

from fmha_iree.paths.base import Refused
from fmha_iree.paths.tiles import TILES
from fmha_iree.problem.spec import check_batch
from common import route, run_batch

from reference import assert_close, attention_ref, make_qkv, seed_of

@pytest.fixture(autouse=True)
def no_tiles(monkeypatch):
    """These tests are about ``fwd``: the problems ``fwd_tiles`` would take stay on it
    (test_key_tiles.py checks the same problems through the tiles)."""
    monkeypatch.setattr(type(TILES), "plan", lambda self, prob, caps: Refused(("off in this test",)))


@pytest.fixture(scope="module")
def fwd_module(ragged_module):
    """The GPU formulation's llvm-cpu builds test_ragged.py uses too (``conftest.ragged_module``:
    one compile per key and machine)."""
    return ragged_module


def _check(mod, q, k, v, mask, *, layout="bhsd", dtype=torch.float32, what=""):
    p = check_batch(q, k, v, mask=mask, scale=None, layout=layout, cu_seqlen_q=None, cu_seqlen_k=None)
    assert route(mod, p).path == "fwd", f"{what}: expected the fwd entry point"
    out, lse = run_batch(mod, p)
    ref_out, ref_lse = attention_ref(q, k, v, mask=mask, layout=layout)
    assert_close(out, ref_out, dtype, what=f"fwd out {what}")
    assert_close(lse, ref_lse, dtype, kind="lse", what=f"fwd lse {what}")
    return out, lse


MASKS = ["0", "b", "t", "b:20,0", "t:3,40", "b:0,0", "xb:9", "t:-1,5"]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("sq,sk", [(77, 130), (130, 77), (1, 129), (127, 1), (200, 200)],
                         ids=["77x130", "130x77", "1x129", "127x1", "200x200"])
def test_fwd_every_mask_and_tail(fwd_module, mask, sq, sk):
    q, k, v = make_qkv(seed_of("fwd", mask, sq, sk), B=2, Hq=4, Hk=2, Sq=sq, Sk=sk, Dq=64)
    _check(fwd_module("f32", "bhsd", 2, 64), q, k, v, mask, what=f"{mask} {sq}x{sk}")


@pytest.mark.parametrize("sq,sk,mask", [(700, 700, "b"), (1100, 1100, "t"), (300, 2000, "b"), (900, 640, "b:200,0"),
                                        (513, 1500, "t:100,-1")],
                         ids=["700-b", "1100-t", "300x2000-b", "900x640-window", "513x1500-t"])
def test_fwd_groups_of_rows(fwd_module, sq, sk, mask):
    """Lengths past one group of rows (512 here): several groups, interiors and both edges,
    groups past Sq left empty."""
    q, k, v = make_qkv(seed_of("fwd-groups", sq, sk, mask), B=1, Hq=2, Hk=1, Sq=sq, Sk=sk, Dq=64)
    _check(fwd_module("f32", "bhsd", 2, 64), q, k, v, mask, what=f"{mask} {sq}x{sk}")


# Windows whose band of keys is at most half of Sk: the banded path
# (``kernels.banded``: every group of 64 rows over its pages of 64 keys, all groups in one op).
# Sq > Sk (the first 176 rows see no key), a band with an interior and groups cut by both ends
# of the keys, top-left with keys on both sides, a chunk with lookahead, wide bands whose first
# groups are cut by key 0 (their pages split into whole and masked ones), Sk no multiple of 64
# (K / V copied to whole pages); GQA / MQA, both layouts, the three dtypes, head dims computed
# padded (96 / 48).
BANDS = [("f32", "bhsd", 2, 64, None, 1, 1200, 1024, "b:100,0"), ("f32", "bhsd", 2, 64, None, 2, 2000, 2048, "b:300,0"),
         ("f32", "bhsd", 2, 64, None, 1, 640, 2048, "t:100,50"), ("f32", "bhsd", 2, 64, None, 2, 333, 1024, "b:64,64"),
         ("f16", "bshd", 4, 64, 32, 2, 700, 1024, "b:128,0"), ("bf16", "bshd", 1, 64, None, 1, 1000, 1024, "b:256,0"),
         ("f32", "bshd", 2, 96, 48, 1, 512, 1024, "t:100,0"), ("f32", "bhsd", 2, 64, None, 2, 2048, 2048, "b:700,0"),
         ("bf16", "bshd", 1, 64, None, 2, 1536, 2048, "b:600,40"), ("f32", "bhsd", 2, 64, None, 2, 1000, 1001, "b:300,0"),
         ("f16", "bshd", 4, 64, 32, 1, 700, 777, "t:70,90"), ("f32", "bshd", 2, 96, 48, 1, 640, 1000, "b:200,0")]


@pytest.mark.parametrize("dtype,layout,group,dq,dv,B,sq,sk,mask", BANDS, ids=[f"{b[0]}-{b[1]}-g{b[2]}-{b[6]}x{b[7]}-{b[8]}"
                                                                              for b in BANDS])
def test_fwd_sliding_window_bands(fwd_module, dtype, layout, group, dq, dv, B, sq, sk, mask):
    dt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[dtype]
    hk = 2 if group < 4 else 1
    q, k, v = make_qkv(seed_of("fwd-band", dtype, layout, sq, sk, mask), B=B, Hq=hk * group, Hk=hk, Sq=sq, Sk=sk, Dq=dq,
                       Dv=dv, layout=layout, dtype=dt)
    _check(fwd_module(dtype, layout, group, dq, dv), q, k, v, mask, layout=layout, dtype=dt, what=f"band {mask} {sq}x{sk}")


def test_fwd_rows_that_see_nothing(fwd_module):
    """Bottom-right causal with Sq > Sk: the first Sq - Sk rows see no key (out 0, lse -inf)."""
    q, k, v = make_qkv(seed_of("fwd-empty"), B=1, Hq=2, Hk=1, Sq=150, Sk=60, Dq=64)
    out, lse = _check(fwd_module("f32", "bhsd", 2, 64), q, k, v, "b", what="b 150x60")
    assert (np.asarray(out)[:, :, :90] == 0).all()
    assert np.isneginf(np.asarray(lse)[:, :, :90]).all()


@pytest.mark.parametrize("sk", [1, 63, 1000, 8192])
def test_fwd_decode(fwd_module, sk):
    """One query row per head against up to 8192 keys: the short-query tier, split over the keys."""
    q, k, v = make_qkv(seed_of("fwd-decode", sk), B=3, Hq=8, Hk=4, Sq=1, Sk=sk, Dq=64)
    _check(fwd_module("f32", "bhsd", 2, 64), q, k, v, "b", what=f"decode Sk={sk}")


@pytest.mark.parametrize("sq", [2, 5, 33])
def test_fwd_short_queries_causal(fwd_module, sq):
    q, k, v = make_qkv(seed_of("fwd-short", sq), B=2, Hq=8, Hk=4, Sq=sq, Sk=777, Dq=64)
    _check(fwd_module("f32", "bhsd", 2, 64), q, k, v, "b", what=f"short Sq={sq}")


@pytest.mark.parametrize("mask", ["0", "b", "b:64,0", "t:7,7"])
def test_fwd_mqa_bshd_dv_f16(fwd_module, mask):
    """MQA (one KV head), the bshd layout, Dv != Dq, f16."""
    q, k, v = make_qkv(seed_of("fwd-mqa", mask), B=2, Hq=4, Hk=1, Sq=99, Sk=301, Dq=64, Dv=32, layout="bshd",
                       dtype=torch.float16)
    _check(fwd_module("f16", "bshd", 4, 64, 32), q, k, v, mask, layout="bshd", dtype=torch.float16, what=f"mqa {mask}")


@pytest.mark.parametrize("mask", ["0", "b", "t:7,7"])
def test_fwd_bf16(fwd_module, mask):
    q, k, v = make_qkv(seed_of("fwd-half", "bf16", mask), B=2, Hq=2, Sq=70, Sk=190, Dq=64, dtype=torch.bfloat16,
                       layout="bshd")
    _check(fwd_module("bf16", "bshd", 1, 64), q, k, v, mask, layout="bshd", dtype=torch.bfloat16, what=f"bf16 {mask}")


@pytest.mark.parametrize("sq,sk,mask", [(77, 130, "b"), (130, 77, "t:3,40"), (1, 63, "0"), (1, 1000, "b"), (200, 200, "0")],
                         ids=["77x130-b", "130x77-window", "1x63", "decode-1000", "200x200"])
def test_fwd_padded_head_dims(fwd_module, sq, sk, mask):
    """Head dims without tiles of their own (Dq 96, Dv 48) run zero-padded to 128 / 64: every
    path (groups, split-KV, the short tier, the padded-keys copy) returns the argument's Dv."""
    q, k, v = make_qkv(seed_of("fwd-dpad", sq, sk, mask), B=2, Hq=4, Hk=2, Sq=sq, Sk=sk, Dq=96, Dv=48, layout="bshd")
    out, _ = _check(fwd_module("f32", "bshd", 2, 96, 48), q, k, v, mask, layout="bshd", what=f"d96/48 {mask} {sq}x{sk}")
    assert out.shape[-1] == 48


def test_fwd_module_carries_its_entry_point(fwd_module):
    """The module exports ``fwd``; batch problems with cu_seqlen padding take another path."""
    mod = fwd_module("f32", "bhsd", 2, 64)
    assert mod.caps.has("fwd")
    q, k, v = make_qkv(seed_of("fwd-pad"), B=2, Hq=4, Hk=2, Sq=40, Sk=50, Dq=64)
    cu = np.array([0, 30, 70], np.int32)
    p = check_batch(q, k, v, mask="b", scale=None, layout="bhsd", cu_seqlen_q=None, cu_seqlen_k=cu)
    assert route(mod, p).path != "fwd"
