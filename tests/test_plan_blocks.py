"""The tile plan's state blocks (``plan.Block``): a plan cut into blocks of tiles, each block run
from its own state and the states joined for ``finalize``, gives the whole problem's results."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fmha_iree
from fmha_iree.problem import plan as plan_mod
from fmha_iree.problem.mask import Mask
from fmha_iree.problem.plan import Sequences, build_plan, state_tiles, units_budget
from fmha_iree.problem.tiles import default_tiles
from common import MAIN, check_fwd
from reference import assert_close, attention_ref, make_qkv, seed_of

CPU_TILES = fmha_iree.TileConfig(m0=128, n0=128, k0=32, n1=64, k1=32, kv_chunk=128)


def _units(p) -> list[tuple]:
    """Every unit of a plan as (absolute tile, other descriptor columns), sorted."""
    rows = [(int(d[0]) + blk.t0, *map(int, d[1:])) for blk in p.blocks for c in blk.calls for d in c]
    return sorted(rows)


@pytest.mark.parametrize("block", [1, 3, 4, 100])
@pytest.mark.parametrize("mask", ["0", "b", "t:40,300"])
def test_blocks_hold_the_same_units(block, mask):
    """Blocks partition the tiles; each holds exactly its tiles' units, relative to its first
    tile, with every call within the unit budget and no tile twice in a call."""
    seqs = Sequences.batch(np.array([700, 1, 300]), np.array([650, 900, 300]))
    m = Mask.from_str(mask)
    whole = build_plan(seqs, m, CPU_TILES, (3, 700), (3, 700), 5)
    cut = build_plan(seqs, m, CPU_TILES, (3, 700), (3, 700), 5, block)
    assert len(whole.blocks) == 1 and whole.n_units > 0
    assert [b.t0 for b in cut.blocks] == list(range(0, cut.n_tiles, min(block, cut.n_tiles)))
    assert sum(b.n_tiles for b in cut.blocks) == cut.n_tiles == whole.n_tiles
    assert _units(cut) == _units(whole)
    for blk in cut.blocks:
        for call in blk.calls:
            assert 0 < len(call) <= 5
            assert len(set(call[:, 0])) == len(call)
            assert ((call[:, 0] >= 0) & (call[:, 0] < blk.n_tiles)).all()


@pytest.mark.parametrize("mask", ["0", "b", "t", "b:200,0", "t:40,300", "xb:96"])
def test_unmasked_calls_see_every_key(mask):
    """With ``split_unmasked`` the plan holds the same units; a call marked unmasked has only units
    whose R rows all lie in their sequence and see every key of their C-key chunk (checked row by
    row against the mask's own visibility), and every wave's unmasked units that are not in such
    calls number fewer than a call holds."""
    seqs = Sequences.batch(np.array([700, 1, 300, 1024]), np.array([650, 900, 300, 1024]))
    m = Mask.from_str(mask)
    R, C = CPU_TILES.m0, CPU_TILES.kv_chunk
    plain = build_plan(seqs, m, CPU_TILES, (4, 1024), (4, 1024), 3)
    split = build_plan(seqs, m, CPU_TILES, (4, 1024), (4, 1024), 3, 0, split_unmasked=True)
    assert _units(split) == _units(plain)
    assert not any(any(b.unmasked) for b in plain.blocks)

    def whole(d) -> bool:
        qrel0, krel0, qlen, klen = (int(d[i]) for i in (4, 5, 6, 7))
        if qrel0 + R > qlen or krel0 + C > klen:
            return False
        i = np.arange(qrel0, qrel0 + R)[:, None]
        j = np.arange(krel0, krel0 + C)[None, :]
        y, x = m.coords(np.array(qlen), np.array(klen))
        return bool(((j >= i - int(y) + 1) & (j < i + int(x))).all())

    # a unit's wave is its rank among its tile's chunks
    chunks = {}
    for t, *rest in _units(split):
        chunks.setdefault(t, []).append(rest[4])
    wave = {(t, k): sorted(ks).index(k) for t, ks in chunks.items() for k in ks}
    n_open, left = 0, {}
    for blk in split.blocks:
        for call, unmasked in zip(blk.calls, blk.unmasked):
            kinds = [whole(d) for d in call]
            if unmasked:
                assert all(kinds) and len(call) == 3
                n_open += len(call)
            for d, k in zip(call, kinds):
                w = wave[(int(d[0]) + blk.t0, int(d[5]))]
                left[w] = left.get(w, 0) + (k and not unmasked)
    assert all(n < 3 for n in left.values())
    if mask in ("0", "b"):
        assert n_open > 0, "the 1024 x 1024 sequence has whole units"


def test_state_tiles_budget():
    """Blocks hold at least one call's units; the GPU keeps one block."""
    assert state_tiles(8, 64, CPU_TILES, "cpu") == (16 << 20) // (4 * 8 * 128 * 66)
    assert state_tiles(64, 64, CPU_TILES, "cpu") >= units_budget(64, CPU_TILES, "cpu")
    assert state_tiles(8, 64, CPU_TILES, "cuda") == 0


CASES = [  # (id, B, Sq, Sk, mask): at the smallest budget, blocks of one call's units
    ("square-causal", 3, 600, 600, "b"),
    ("square-none", 3, 600, 600, None),
    ("q-shorter-window", 3, 300, 700, "b:100,0"),
    ("q-longer-top-left", 2, 900, 400, "t"),
]


@pytest.mark.parametrize("name,B,sq,sk,mask", CASES, ids=[c[0] for c in CASES])
def test_batch_mode_in_blocks(monkeypatch, name, B, sq, sk, mask):
    """Batch mode through the plan with the smallest blocks equals the float64 reference."""
    monkeypatch.setitem(plan_mod.STATE_BUDGET, "cpu", 1)
    hq, tiles = 8, default_tiles("cpu", 64, 64)  # the tiles check_fwd's module has
    per_block = state_tiles(hq, 64, tiles, "cpu")
    assert per_block == units_budget(hq, tiles, "cpu")
    assert B * -(-sq // tiles.m0) > per_block, "the case must make several blocks"
    q, k, v = make_qkv(seed_of("plan-blocks", name), B=B, Hq=hq, Sq=sq, Sk=sk, dtype=MAIN["dtype"])
    check_fwd(q, k, v, mask=mask, what=name)


def test_nan_row_in_blocks(monkeypatch):
    """A NaN query row in the second block's first slot stays NaN in its own output and LSE and
    reaches no other row once the blocks' states are joined."""
    monkeypatch.setitem(plan_mod.STATE_BUDGET, "cpu", 1)
    monkeypatch.setitem(plan_mod.SCORE_BUDGET, "cpu", 1)
    tiles = default_tiles("cpu", 64, 64)
    assert state_tiles(2, 64, tiles, "cpu") == 1, "one tile per block: batch 1 is the second block"
    q, k, v = make_qkv(seed_of("plan-blocks", "nan"), B=2, Hq=2, Sq=40, Sk=40, Dq=64)
    q[1, 0, 0, 5] = float("nan")
    out, lse = fmha_iree.fmha_fwd(q, k, v, mask="t", return_lse=True)
    ref_out, ref_lse = attention_ref(q, k, v, mask="t")
    expect = np.isnan(ref_out).any(axis=-1)
    assert expect.sum() == 1 and expect[1, 0, 0]
    np.testing.assert_array_equal(torch.isnan(out).any(dim=-1).numpy(), expect)
    np.testing.assert_array_equal(torch.isnan(lse).numpy(), np.isnan(ref_lse))
    assert_close(out, ref_out, torch.float32, what="nan in blocks")
    assert_close(lse, ref_lse, torch.float32, kind="lse", what="nan in blocks")
