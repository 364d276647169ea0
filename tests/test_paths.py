"""The selector on its own (``fmha_iree.paths``): for module capabilities written out here (no
module is compiled or loaded), which path each problem of each mode takes, and the reasons every
path before it gives for refusing it. The numbers of each path are tested elsewhere, on modules
(test_ragged.py, test_key_tiles.py, test_fwd_cpu.py, test_waves_cpu.py, ...)."""

import numpy as np
import pytest

from fmha_iree.problem.paged import check_paged
from fmha_iree.paths import ORDER, NoPath, Problem, select
from fmha_iree.paths.capabilities import Capabilities, DenseCaps, TilesCaps
from fmha_iree.paths.dispatch import paged_problem
from fmha_iree.problem.spec import check_batch, check_varlen
from fmha_iree.problem.tiles import TileConfig

TILES = TileConfig(m0=128, n0=64, k0=32, n1=128, k1=32, kv_chunk=256)
GPU = ("fwd", "fwd_ragged", "fwd_tiles", "fwd_tiles_paged", "fwd_packed", "fwd_packed_paged", "fwd_packed_pages",
       "dense")
CPU = ("init", "step", "step_open", "finalize", "rows", "rows_kpad", "units", "waves_varlen", "units_varlen",
       "rows_packed", "rows_packed_pages")


def caps(formulation="gpu", layout="bshd", group=2, entries=None, dense=None, key_tiles=None):
    if entries is None:
        entries = GPU if formulation == "gpu" else CPU
        if layout == "bhsd":  # the packed entries read bshd rows; group mode's CPU calls too
            entries = tuple(e for e in entries if not e.startswith(("fwd_packed", "fwd_tiles_paged", "units_varlen",
                                                                    "rows_packed")))
    if key_tiles is None and "fwd_tiles" in entries:
        key_tiles = TilesCaps(rows=128, group=group, ew=192, step=64)
    return Capabilities("m", formulation, "cuda" if formulation == "gpu" else "cpu", layout, "f32", group, 64, 64,
                        TILES, frozenset(entries), unit_rows=0 if formulation == "gpu" else 64, dense=dense,
                        key_tiles=key_tiles)


def batch(b, sq, sk, mask="b", layout="bshd", hq=4, hk=2, cu_q=None, cu_k=None, with_lse=True):
    shape = (lambda s, h: (b, s, h, 64)) if layout == "bshd" else (lambda s, h: (b, h, s, 64))
    q, k, v = (np.zeros(shape(s, h), np.float32) for s, h in ((sq, hq), (sk, hk), (sk, hk)))
    cu = (lambda x: None if x is None else np.concatenate([[0], np.cumsum(x)]).astype(np.int32))
    p = check_batch(q, k, v, mask=mask, scale=None, layout=layout, cu_seqlen_q=cu(cu_q), cu_seqlen_k=cu(cu_k))
    return Problem("batch", p, with_lse)


def group(lq, lk, mask="b", hq=4, hk=2):
    sq, sk = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lq, lk))
    q = np.zeros((int(sq[-1]), hq, 64), np.float32)
    k = np.zeros((max(int(sk[-1]), 1), hk, 64), np.float32)
    p, starts = check_varlen(q, k, k.copy(), sq, sk, seqlen_k=None, seqstart_padded_q=None, seqstart_padded_k=None,
                             mask=mask, scale=None)
    return Problem("group", p, True, starts)


def paged(lq, lk, page=64, mask="b", hq=4, hk=2):
    n = [-(-x // page) for x in lk]
    bt = np.zeros((len(lk), max(max(n), 1)), np.int32)
    at = 0
    for b, m in enumerate(n):
        bt[b, :m] = np.arange(at, at + m)
        at += m
    kc = np.zeros((max(at, 1), page, hk, 64), np.float32)
    sq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    q = np.zeros((int(sq[-1]), hq, 64), np.float32)
    cache = check_paged(kc, kc.copy(), sq, None, np.array(lk, np.int32), None, bt)
    return paged_problem(q, cache, sq, None, mask=mask, scale=None, with_lse=True)


def refused(route, name):
    """The reasons ``route`` lists for path ``name``, joined."""
    found = dict(route.rejected)
    assert name in found, f"{name} was not tried before {route.path}: {route}"
    return " ".join(found[name])


GPU_CASES = [  # (problem, path taken, {refused path: words of its reasons})
    (lambda: batch(2, 300, 300), "fwd", {"tiles": "SQUARE_CAUSAL_MIN", "ragged": "without cu_seqlen padding",
                                         "compiled_in": "no compiled-in or aligned", "rows": "no rows"}),
    (lambda: batch(2, 2048, 2048), "tiles", {}),
    (lambda: batch(2, 2048, 2048, "b:100,0"), "fwd", {"tiles": "measured faster"}),
    (lambda: batch(3, 200, 300, cu_q=[200, 10, 50], cu_k=[3, 300, 77]), "tiles", {}),
    (lambda: batch(3, 1, 300, cu_q=[1, 1, 1], cu_k=[3, 300, 77]), "packed", {"tiles": "decode-shaped"}),
    (lambda: batch(3, 1, 300, layout="bhsd", cu_q=[1, 1, 1], cu_k=[3, 300, 77]), "ragged", {}),
    (lambda: group([700, 64, 3], [700, 64, 300]), "tiles", {}),
    (lambda: group([1] * 9, [5, 600, 64, 0, 1, 300, 2, 7, 9]), "packed", {"tiles": "decode-shaped"}),
    (lambda: group([20, 20], [20, 400]), "ragged", {"tiles": "fewer query rows", "packed": "not decode-shaped"}),
    (lambda: paged([100, 30], [300, 30]), "tiles", {}),
    (lambda: paged([1, 1, 2], [300, 1, 64]), "packed", {"tiles": "decode-shaped"}),
]


@pytest.mark.parametrize("case", range(len(GPU_CASES)))
def test_gpu_routes_and_reasons(case):
    make, path, why = GPU_CASES[case]
    prob = make()
    r = select(prob, caps("gpu", layout=prob.p.layout))
    assert r.path == path, str(r)
    assert r.call is not None and r.entry is not None
    for name, words in why.items():
        assert words in refused(r, name), str(r)
    assert [n for n, _ in r.rejected] == [p.name for p in ORDER[prob.mode][:len(r.rejected)]]


def test_gpu_aligned_and_compiled_in():
    d = DenseCaps(64, seqlens=(512,), causal_o=(512,))
    r = select(batch(2, 512, 512, "b", with_lse=False), caps(dense=d))
    assert (r.path, r.entry) == ("compiled_in", "causal_o_s512")
    r = select(batch(2, 512, 512, "b"), caps(dense=d))  # causal with the LSE: the generic entries
    assert (r.path, r.entry) == ("fwd", "fwd") and "no compiled-in entry takes" in refused(r, "compiled_in")
    r = select(batch(2, 256, 640, "0"), caps(dense=d))
    assert (r.path, r.entry) == ("dense", "dense")
    assert "no compiled-in entry takes Sq=256, Sk=640" in refused(r, "compiled_in")
    r = select(batch(2, 250, 640, "0"), caps(dense=d))
    assert r.path == "fwd" and "not multiples of the module's alignment 64" in refused(r, "dense")
    r = select(batch(2, 512, 512, "b:30,0"), caps(dense=d))
    assert r.path == "fwd" and "neither unmasked nor causal" in refused(r, "compiled_in")


CPU_CASES = [
    (lambda: batch(2, 30, 300), "rows", {"cpu_group": "measured faster elsewhere", "compiled_in": "no compiled-in"}),
    (lambda: batch(2, 300, 300), "cpu_group", {}),
    (lambda: batch(2, 300, 3000), "units", {"rows": "ROWS_MAX_ROWS", "tiles": "no fwd_tiles", "ragged": "no fwd"}),
    (lambda: batch(2, 600, 3000, layout="bhsd", cu_k=[3000, 5]), "plan", {"cpu_group": "measured faster",
                                                                          "units": "cu_seqlen padding"}),
    (lambda: group([700, 64, 3], [700, 64, 300]), "cpu_group", {"tiles": "no fwd_tiles", "ragged": "no fwd_ragged"}),
    (lambda: paged([1, 1, 2], [300, 1, 64]), "cpu_pages", {"packed": "no fwd_packed"}),
    (lambda: paged([100, 1], [300, 1]), "cpu_gather", {"cpu_pages": "more query rows than rows_packed takes"}),
]


@pytest.mark.parametrize("case", range(len(CPU_CASES)))
def test_cpu_routes_and_reasons(case):
    make, path, why = CPU_CASES[case]
    prob = make()
    r = select(prob, caps("cpu", layout=prob.p.layout))
    assert r.path == path, str(r)
    for name, words in why.items():
        assert words in refused(r, name), str(r)
    assert str(r).splitlines()[0].startswith(f"{prob.mode} mode: {path}")


def test_empty_problems_call_nothing():
    r = select(group([0, 0], [5, 0]), caps())
    assert (r.path, r.entry) == ("empty", None)
    out, lse = r.call.run(None, None, None, None, keep=False)
    assert not out.any() and np.isneginf(lse).all()


def test_no_path_lists_every_reason():
    with pytest.raises(NoPath) as e:
        select(group([30], [30]), caps(entries=("dense",)))
    msg = str(e.value)
    assert all(f"  {p.name}:" in msg for p in ORDER["group"]), msg


def test_capabilities_are_read_from_the_record():
    rec = {"module": "m", "formulation": "gpu", "family": "cuda", "layout": "bshd", "dtype": "f16", "group": 4,
           "dq": 128, "dv": 128, "tiles": {"kM0": 128, "kN0": 64, "kK0": 32, "kN1": 128, "kK1": 32, "kv_chunk": 256},
           "entries": ["fwd", "fwd_tiles"], "unit_rows": 0,
           "dense": {"align": 64, "seqlens": [512], "causal_o": [], "tiled": True, "dynamic": True},
           "key_tiles": {"rows": 128, "group": 4, "ew": 192, "step": 64}}
    c = Capabilities.from_record(rec, {"fwd", "fwd_tiles", "other"})
    assert c.has("fwd", "fwd_tiles") and not c.has("fwd_ragged") and c.key_tiles.positions == 32
    assert c.dense.seqlens == (512,) and c.typed_bf16
    with pytest.raises(ValueError, match="lacks the entry points its manifest lists: \\['fwd_tiles'\\]"):
        Capabilities.from_record(rec, {"fwd"})
