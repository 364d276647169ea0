"""Group-mode calls prepared once and replayed (``fmha_iree.runtime.prepared``): a repeated call on
DeviceTensors with the same metadata values runs the first call's entry point, index table and
scalars on the new tensors' data. Checked on the GPU modules' formulation built for llvm-cpu
against the float64 reference; keys against the metadata's values."""

import numpy as np
import pytest
import torch

from fmha_iree.runtime.device import DeviceTensor
from fmha_iree.problem.paged import check_paged
from fmha_iree.runtime.prepared import PreparedCalls, varlen_call_key
from fmha_iree.problem.spec import check_varlen

from common import run_group, run_paged
from reference import assert_close, seed_of, varlen_ref

DEV = "local-task"


def _starts(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _up(x: torch.Tensor) -> DeviceTensor:
    return DeviceTensor.from_host(x.numpy(), "f32", DEV)


def _tensors(seed, shapes):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) for s in shapes]


# decode (fwd_packed, keys read in place), a prefill (fwd_ragged) and sequences with gaps
# (seqlen_k shorter than the runs: fwd_packed_paged, keys gathered)
CASES = [("decode", [1] * 5, [70, 1, 300, 0, 64], None), ("prefill", [40, 3, 90], [40, 200, 90], None),
         ("seqlen_k", [1, 1, 1], [90, 400, 33], [60, 257, 1])]


@pytest.mark.parametrize("mask", ["b", "t:20,0"])
@pytest.mark.parametrize("name,lq,lk,used", CASES, ids=[c[0] for c in CASES])
def test_group_mode_replay_runs_on_new_data(ragged_module, name, lq, lk, used, mask):
    """The first call stores its replay; the replay on other tensors of the same shapes gives
    those tensors' attention (float64 reference), LSE included."""
    mod, calls = ragged_module(), PreparedCalls()
    sq, sk = _starts(lq), _starts(lk)
    seqlen_k = None if used is None else np.array(used, np.int32)
    shapes = ((int(sq[-1]), 4, 64), (int(sk[-1]), 2, 64), (int(sk[-1]), 2, 64))
    first = [_up(x) for x in _tensors(seed_of("prepared", name, mask), shapes)]
    key = varlen_call_key(*first, (sq, sk, seqlen_k), "varlen", mask, None, True)
    assert key is not None
    p, starts = check_varlen(*first, sq, sk, seqlen_k=seqlen_k, seqstart_padded_q=None, seqstart_padded_k=None,
                             mask=mask, scale=None)
    run_group(mod, p, starts, memo=calls.memo(key))
    replay = calls.get(varlen_call_key(*first, (sq.copy(), sk.copy(), seqlen_k), "varlen", mask, None, True))
    assert replay is not None, "an equal key (equal values) finds the stored replay"
    for trial in range(2):
        new = _tensors(seed_of("prepared-new", name, mask, trial), shapes)
        out, lse = replay(*(_up(x) for x in new))
        ref_out, ref_lse = varlen_ref(*new, sq, sk, seqlen_k=seqlen_k, mask=mask)
        assert_close(out.to_numpy(), ref_out, torch.float32, what=f"replay {name} {mask} out")
        assert_close(lse.to_numpy(), ref_lse, torch.float32, kind="lse", what=f"replay {name} {mask} lse")


@pytest.mark.parametrize("page", [16, 64])
def test_paged_replay_runs_on_new_pages(ragged_module, page):
    """A paged decode's replay reads the new caches' pages through the first call's block table."""
    mod, calls = ragged_module(), PreparedCalls()
    lq, lk = [1, 1, 2, 1], [40, 130, 1, 64]
    rng = np.random.default_rng(seed_of("prepared-paged", page))
    n_pages = sum(-(-n // page) for n in lk) + 2
    free = list(rng.permutation(n_pages))
    bt = np.zeros((len(lk), max(-(-n // page) for n in lk)), np.int32)
    for b, n in enumerate(lk):
        for i in range(-(-n // page)):
            bt[b, i] = free.pop()
    sq, lens = _starts(lq), np.array(lk, np.int32)
    shapes = ((int(sq[-1]), 4, 64), (n_pages, page, 2, 64), (n_pages, page, 2, 64))
    first = [_up(x) for x in _tensors(seed_of("prepared-paged-first", page), shapes)]
    key = varlen_call_key(*first, (sq, None, lens, None, None, bt), "varlen", "b", None, False)
    cache = check_paged(first[1], first[2], sq, None, lens, None, bt)
    run_paged(mod, first[0], cache, sq, mask="b", with_lse=False, memo=calls.memo(key))
    replay = calls.get(key)
    assert replay is not None
    q, kc, vc = _tensors(seed_of("prepared-paged-new", page), shapes)
    out = replay(_up(q), _up(kc), _up(vc))
    rows = [(int(bt[b, j // page]), j % page) for b in range(len(lk)) for j in range(lk[b])]
    k, v = (torch.stack([c[pg, r] for pg, r in rows]) for c in (kc, vc))
    ref_out, _ = varlen_ref(q, k, v, sq, _starts(lk), mask="b")
    assert_close(out.to_numpy(), ref_out, torch.float32, what=f"paged replay p{page}")


def test_keys_follow_the_metadata_values():
    """Keys differ with any metadata value (a composition the replay was not made for never
    replays) and with argument types; device-resident metadata is not keyed."""
    q, k, v = (_up(torch.zeros(s)) for s in ((4, 4, 64), (9, 2, 64), (9, 2, 64)))
    sq, sk = np.array([0, 2, 4], np.int32), np.array([0, 5, 9], np.int32)
    base = varlen_call_key(q, k, v, (sq, sk), "b", None)
    assert base == varlen_call_key(q, k, v, (torch.from_numpy(sq.copy()), sk), "b", None)
    assert base != varlen_call_key(q, k, v, (sq, np.array([0, 4, 9], np.int32)), "b", None)
    assert base != varlen_call_key(q, k, v, (sq, sk.astype(np.int64)), "b", None)
    assert base != varlen_call_key(q, k, v, (sq, sk), "b", 1.0)
    assert base != varlen_call_key(q, k, v, (sq, sk, np.array([5, 3], np.int32)), "b", None)
    assert varlen_call_key(q, k, v, (sq, _up(torch.zeros(3))), "b", None) is None
    assert varlen_call_key(q.to_numpy(), k, v, (sq, sk), "b", None) is None  # host arrays: planned per call
