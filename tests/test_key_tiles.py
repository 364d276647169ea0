"""Group mode as tiles over their own keys (``fwd_tiles``, ``fmha_iree.paths.tiles``): the host's
table against a brute-force visibility count, the problems the path refuses and why, and whole
calls on the GPU modules' formulation built for llvm-cpu (where CI runs) against the float64
reference, with the path checked to be the one taken.

Covered: tails of 1..127 rows and keys around the tiles and key steps, Sq < Sk and Sq > Sk per
sequence, zero-length q or k, every mask (none, causal either alignment, windows on either side
and both), ``seqlen_k``, padded starts with NaN in the gaps (a neighbour's NaN stays out of
the edge copies), GQA with Dq != Dv, f32 / f16 / bf16, LSE; a paged cache's prefill (scattered pages, partly
filled last pages, NaN in every row no sequence owns); batch mode in both layouts, with and
without cu_seqlen padding (test_ragged.py's cu_seqlen batches, NaN in the padding, run through
the tiles too), and the batches that keep other paths."""

import collections

import numpy as np
import pytest
import torch

from fmha_iree.problem.abi import TILE_COLUMNS
from fmha_iree.problem.mask import Mask
from fmha_iree.problem.paged import check_paged
from fmha_iree.paths import frame as frames, policy, tiles as key_tiles
from fmha_iree.paths import tiles as tiles_path
from fmha_iree.paths.base import Problem
from fmha_iree.paths.capabilities import TilesCaps
from fmha_iree.problem.spec import check_batch

import test_ragged as ragged
from common import cu, route, run_batch, run_paged
from reference import assert_close, attention_ref, make_qkv, seed_of

INFO = TilesCaps(rows=64, group=2, ew=192, step=64)  # the llvm-cpu build's (entries.tiles_record)
TILE_FIELDS = len(TILE_COLUMNS)
TAKEN = ["0", "b", "t", "t:-1,5", "b:-1,3", "xb:0", "b:-1,0", "b:20,0", "t:3,40", "xb:9", "b:100,7", "t:70,-1"]


def _starts(lq, lk, pad_q=0, pad_k=0):
    lq, lk = np.asarray(lq, np.int64), np.asarray(lk, np.int64)
    qs = np.concatenate([[0], np.cumsum(lq + pad_q)[:-1]])
    ks = np.concatenate([[0], np.cumsum(lk + pad_k)[:-1]])
    return qs, lq, ks, lk, np.concatenate([[0], np.cumsum(lq)[:-1]]), int(lq.sum())


@pytest.mark.parametrize("mask", TAKEN)
@pytest.mark.parametrize("seed", range(4))
def test_table_covers_what_each_row_sees(mask, seed):
    """Every row of a tile sees all of the interior ``[lo, lo + nk)``; what else it sees is in
    its edge (``nl`` keys before the interior, the rest of ``ne`` after it); counts are whole key
    steps within the module's bound; every query row is mapped to its own tile row once, rows no
    sequence owns to -1."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 9))
    lq, lk = rng.integers(0, 300, n), rng.integers(0, 400, n)
    lq[0] = max(lq[0], 40)
    starts = _starts(lq, lk, pad_q=int(rng.integers(0, 3)))
    tq = int(starts[0][-1] + lq[-1]) + 5
    m = Mask.from_str(mask)
    assert key_tiles.reasons(INFO, starts[1], tq, int(lk.sum()) + 1) == []
    idx, n_tiles, widest = key_tiles.tile_table(INFO, m, starts, tq)
    table = idx[: n_tiles * TILE_FIELDS].reshape(n_tiles, -1).astype(np.int64)
    out_map, lse_map = idx[n_tiles * TILE_FIELDS:][:tq], idx[n_tiles * TILE_FIELDS + tq:]
    pos = INFO.positions
    assert (np.diff(table[:, 2] + table[:, 3]) <= 0).all(), "tiles longest first"
    col = {name: table[:, i] for i, name in enumerate(TILE_COLUMNS)}
    assert all(((col[c] % INFO.step) == 0).all() for c in ("nk", "ne", "nl", "nh"))
    assert (col["nl"] <= col["nh"]).all() and (col["nh"] <= col["ne"]).all()
    assert (table[:, 3] <= widest).all() and widest <= INFO.ew and widest % INFO.step == 0
    assert (table[:, 0] + pos <= tq).all()
    seen = np.zeros(tq, int)
    for b in range(n):
        vis = m.materialize(int(lq[b]), int(lk[b]))
        for i in range(int(lq[b])):
            r = int(out_map[starts[0][b] + i])
            assert r >= 0 and lse_map[starts[4][b] + i] == r
            t, row = divmod(r, pos)
            q0, k0, nk, ne, pos0 = table[t, :5]
            lo, nl = col["lo"][t], col["nl"][t]
            assert pos0 + row == i and q0 - pos0 == starts[0][b] and k0 == starts[2][b]
            # the first half of a tile's positions reads the edge's first nh keys only
            span = col["nh"][t] if row < pos // 2 else ne
            edge = np.r_[lo - nl:lo, lo + nk:lo + nk + span - nl]
            assert vis[i, lo:lo + nk].all() and lo + nk <= lk[b]
            assert np.isin(np.flatnonzero(vis[i]), np.r_[lo:lo + nk, edge]).all()
            seen[starts[0][b] + i] += 1
    assert (seen[out_map >= 0] == 1).all() and (out_map[seen == 0] == -1).all()


def test_refusals_say_why():
    def why(lq, tq, tk):
        return " ".join(key_tiles.reasons(INFO, np.asarray(lq, np.int64), tq, tk))
    assert "decode-shaped" in why([1, 2], 64, 99)
    assert "fewer query rows" in why([20], 20, 20)
    assert "more than" in why([32 * key_tiles.MAX_TILES + 1], 32 * key_tiles.MAX_TILES + 1, 64)


@pytest.fixture
def taken(monkeypatch):
    """The functions the table-driven calls ran (``paths.frame.TableCall.run``)."""
    used = collections.Counter()
    run = frames.TableCall.run

    def spy(self, *a, **k):
        used[self.entry] += 1
        return run(self, *a, **k)

    monkeypatch.setattr(frames.TableCall, "run", spy)
    return used


COMPOSITIONS = [  # (id, query lengths, key lengths): tails around the 32-position tiles and 64-key steps
    ("tails", [31, 33, 95, 127, 1, 64], [31, 65, 127, 63, 129, 64]),
    ("chunked", [40, 17, 100], [300, 17, 420]),
    ("longer_q", [200, 90], [70, 1]),
    ("empty", [0, 45, 3, 60], [10, 0, 0, 61]),
]


@pytest.mark.parametrize("mask", TAKEN)
@pytest.mark.parametrize("name,lq,lk", COMPOSITIONS, ids=[c[0] for c in COMPOSITIONS])
def test_group_mode_tiles(ragged_module, taken, name, lq, lk, mask):
    ragged._group(ragged_module(), mask, lq, lk, what=f"tiles {name}")
    assert taken == {"fwd_tiles": 1}


def test_seqlen_k_and_nan_gaps(ragged_module, taken):
    """Padded starts with NaN in the gaps and a KV cache longer than used: the edges' copies zero
    what their sequence does not own."""
    lq, lk = [70, 33, 129], [90, 40, 200]
    ragged._group(ragged_module(), "b", lq, lk, pad_q=[3, 0, 5], pad_k=[7, 1, 64], what="tiles gaps")
    ragged._group(ragged_module(), "0", lq, lk, seqlen_k=[80, 40, 150], what="tiles seqlen_k")
    assert taken == {"fwd_tiles": 2}


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_half_types(ragged_module, taken, dtype):
    ragged._group(ragged_module(dtype, "bshd", 1, 64), "b", [70, 200, 5], [70, 260, 5], hq=2, hk=2, dtype=dtype,
                  what=f"tiles {dtype}")
    assert taken == {"fwd_tiles": 1}


def test_gqa_dq_dv(ragged_module, taken):
    ragged._group(ragged_module("f16", "bshd", 4, 64, 32), "t", [50, 9, 130], [80, 9, 100], hq=8, hk=2, dv=32,
                  dtype="f16", what="tiles gqa")
    assert taken == {"fwd_tiles": 1}


# Batch mode: each batch entry a sequence (the route's ``tiles``), either layout.
BATCH = [(77, 130), (130, 77), (127, 1), (200, 200), (33, 300)]


@pytest.mark.parametrize("mask", TAKEN)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("sq,sk", BATCH, ids=[f"{a}x{b}" for a, b in BATCH])
def test_batch_mode_tiles(ragged_module, layout, mask, sq, sk, monkeypatch):
    """Batches of every taken mask and tails through the tiles (routed there whatever their
    shape: the policy keeps short or unmasked unpadded batches on ``fwd``)."""
    monkeypatch.setattr(key_tiles, "_batch_is_slower", lambda prob: None)
    mod = ragged_module("f32", layout, 2)
    q, k, v = make_qkv(seed_of("tiles-batch", layout, mask, sq, sk), B=2, Hq=4, Hk=2, Sq=sq, Sk=sk, Dq=64,
                       layout=layout)
    p = check_batch(q, k, v, mask=mask, scale=None, layout=layout, cu_seqlen_q=None, cu_seqlen_k=None)
    assert route(mod, p).path == "tiles"
    out, lse = run_batch(mod, p)
    ref_out, ref_lse = attention_ref(q, k, v, mask=mask, layout=layout)
    assert_close(out, ref_out, torch.float32, what=f"tiles batch {mask} {sq}x{sk} out")
    assert_close(lse, ref_lse, torch.float32, kind="lse", what=f"tiles batch {mask} {sq}x{sk} lse")


def test_batch_pays():
    """Unpadded batches take the tiles where they were measured faster: square causal ones from
    ``SQUARE_CAUSAL_MIN`` rows; padded ones always."""
    class key_tiles:  # noqa: N801 - the policy's question, as the tiles path asks it
        @staticmethod
        def batch_pays(p):
            return tiles_path._batch_is_slower(Problem("batch", p, True)) is None

    def problem(sq, sk, mask, lens=None):
        q, k, v = make_qkv(seed_of("tiles-pays"), B=2, Hq=2, Hk=2, Sq=sq, Sk=sk, Dq=16)
        cq = None if lens is None else cu(lens)
        return check_batch(q, k, v, mask=mask, scale=None, layout="bhsd", cu_seqlen_q=cq, cu_seqlen_k=cq)
    n = policy.SQUARE_CAUSAL_MIN
    assert key_tiles.batch_pays(problem(n, n, "b")) and key_tiles.batch_pays(problem(n, n, "t"))
    assert not key_tiles.batch_pays(problem(n, n, "0")) and not key_tiles.batch_pays(problem(n - 64, n - 64, "b"))
    assert not key_tiles.batch_pays(problem(n, n + 64, "b"))
    # sliding windows keep fwd's banded path, though their right edge is causal's
    assert not key_tiles.batch_pays(problem(n, n, "b:256,0")) and not key_tiles.batch_pays(problem(n, n, "t:100,0"))
    assert key_tiles.batch_pays(problem(n, n, f"b:{n},0"))  # a window as wide as the keys is causal
    assert key_tiles.batch_pays(problem(100, 100, "0", lens=[100, 60]))


def test_batch_routes_elsewhere(ragged_module):
    """Decode-shaped batches keep split-KV (``fwd``), batches ``batch_pays`` keeps off the tiles
    (unpadded and not square causal, a window here) keep ``fwd``."""
    mod = ragged_module("f32", "bhsd", 2)

    def route_path(p):
        return route(mod, p).path
    q, k, v = make_qkv(seed_of("tiles-route", 3), B=2, Hq=4, Hk=2, Sq=200, Sk=200, Dq=64)
    assert route_path(check_batch(q, k, v, mask="b", scale=None, layout="bhsd", cu_seqlen_q=None,
                                  cu_seqlen_k=None)) == "fwd"
    q, k, v = make_qkv(seed_of("tiles-route"), B=2, Hq=4, Hk=2, Sq=1, Sk=300, Dq=64)
    assert route_path(check_batch(q, k, v, mask="b", scale=None, layout="bhsd", cu_seqlen_q=None,
                                  cu_seqlen_k=None)) == "fwd"
    q, k, v = make_qkv(seed_of("tiles-route", 2), B=2, Hq=4, Hk=2, Sq=200, Sk=300, Dq=64)
    assert route_path(check_batch(q, k, v, mask="b:20,0", scale=None, layout="bhsd", cu_seqlen_q=None,
                                  cu_seqlen_k=None)) == "fwd"


@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("mask", ["b", "0", "t"])
def test_paged_prefill_tiles(ragged_module, taken, page, mask):
    """Group-mode prefill over a paged cache (pages in scattered order, partly filled last pages,
    every row no sequence owns NaN): its used rows gathered in sequence order, then the tiles."""
    lq, lk = [30, 7, 0, 100, 65], [30, 200, 5, 100, 64]
    q, kc, vc, bt = ragged._paged_case(seed_of("tiles-paged", page, mask), lq, lk, page)
    owned = np.zeros(kc.shape[:2], bool)
    for b, n in enumerate(lk):
        for j in range(n):
            owned[bt[b, j // page], j % page] = True
    kc[~torch.from_numpy(owned)] = float("nan")
    vc[~torch.from_numpy(owned)] = float("nan")
    sq = ragged._starts(lq)
    cache = check_paged(kc, vc, sq, None, np.array(lk, np.int32), None, bt)
    out, lse = run_paged(ragged_module(), q, cache, sq, mask=mask)
    ref_out, ref_lse = ragged._paged_reference(q, kc, vc, sq, bt, lk, mask)
    assert_close(out, ref_out, torch.float32, what=f"tiles paged {page} {mask} out")
    assert_close(lse, ref_lse, torch.float32, kind="lse", what=f"tiles paged {page} {mask} lse")
    assert taken == {"fwd_tiles_paged": 1}
