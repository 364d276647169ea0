"""Soak: many mixed calls from several threads at once, every result checked against the float64
reference, and the process's resident memory flat once warm.

Calls mix batch and group mode, dtypes (f32, f16), GQA ratios, masks, lengths (tails of 1..127
rows and keys, Sq != Sk, empty sequences), cu_seqlen padding and LSE. They reuse kernel keys the
other test files compile (f32 g1 d64 bhsd, f32 g1 d32 bhsd, f32 g2 d64 bshd, f16 g2 d64 bshd), so
the soak adds calls, not compiles. ``FMHA_IREE_SOAK_CALLS`` changes the number of calls.
"""

from __future__ import annotations

import os
import random
import threading

import numpy as np
import pytest
import torch

import fmha_iree
from reference import assert_close, attention_ref, make_qkv, varlen_ref

CALLS = int(os.environ.get("FMHA_IREE_SOAK_CALLS", "2000"))
THREADS = 4
MASKS = ["0", "t", "b", "t:5,0", "b:0,7", "xb:6", "b:3,2"]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _lengths(rng: random.Random, n: int) -> list[int]:
    return [rng.choice([0, 1, 3, rng.randint(1, 40), rng.randint(60, 140)]) for _ in range(n)]


def _batch_call(rng: random.Random, seed: int):
    d = rng.choice([64, 32])
    sq, sk = rng.randint(1, 140), rng.randint(1, 140)
    b = rng.randint(1, 3)
    q, k, v = make_qkv(seed, B=b, Hq=2, Sq=sq, Sk=sk, Dq=d)
    kw = dict(mask=rng.choice(MASKS))
    if rng.random() < 0.3:
        # cumulative lengths; batch b uses the first cu[b+1] - cu[b] rows / keys of its slot
        kw["cu_seqlen_q"] = torch.tensor(np.concatenate([[0], np.cumsum([rng.randint(0, sq) for _ in range(b)])]),
                                         dtype=torch.int32)
        kw["cu_seqlen_k"] = torch.tensor(np.concatenate([[0], np.cumsum([rng.randint(0, sk) for _ in range(b)])]),
                                         dtype=torch.int32)
    out, lse = fmha_iree.fmha_fwd(q, k, v, return_lse=True, **kw)
    ref_out, ref_lse = attention_ref(q, k, v, **kw)
    return (out, ref_out, lse, ref_lse, torch.float32), f"batch d{d} B{b} {sq}x{sk} {kw}"


def _varlen_call(rng: random.Random, seed: int):
    dtype = rng.choice([torch.float32, torch.float16])
    n = rng.randint(1, 5)
    lq, lk = _lengths(rng, n), _lengths(rng, n)
    tq, tk = max(sum(lq), 1), max(sum(lk), 1)
    q, k, v = make_qkv(seed, Hq=4, Hk=2, Sq=tq, Sk=tk, Dq=64, dtype=dtype, layout="bshd")
    q, k, v = q[0], k[0], v[0]
    sq = torch.tensor(np.concatenate([[0], np.cumsum(lq)]), dtype=torch.int32)
    sk = torch.tensor(np.concatenate([[0], np.cumsum(lk)]), dtype=torch.int32)
    mask = rng.choice(MASKS)
    out, lse = fmha_iree.fmha_fwd_varlen(q, k, v, sq, sk, mask=mask, return_lse=True)
    ref_out, ref_lse = varlen_ref(q, k, v, sq, sk, mask=mask)
    return (out, ref_out, lse, ref_lse, dtype), f"varlen {dtype} q{lq} k{lk} mask={mask}"


def _one_call(i: int):
    rng = random.Random(i)
    got, what = (_batch_call if rng.random() < 0.5 else _varlen_call)(rng, 1000 + i)
    out, ref_out, lse, ref_lse, dtype = got
    assert_close(out, ref_out, dtype, kind="out", what=what)
    assert_close(lse, ref_lse, dtype, kind="lse", what=what)


def _run(indices, errors: list):
    for i in indices:
        try:
            _one_call(i)
        except Exception as e:  # collected: a failing call must not stop the other threads
            errors.append(f"call {i}: {e!r}"[:600])


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="resident memory read from /proc")
def test_soak_mixed_calls_from_threads():
    warm = 4 * len(MASKS)
    errors: list[str] = []
    _run(range(warm), errors)  # warm-up: compiles or loads every key, fills allocator pools
    assert not errors, errors[:5]
    rss0 = _rss_bytes()
    threads = [threading.Thread(target=_run, args=(range(warm + t, CALLS, THREADS), errors)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    grown = (_rss_bytes() - rss0) / 2**20
    assert not errors, f"{len(errors)} of {CALLS - warm} calls failed, e.g. {errors[:3]}"
    assert grown < 50, f"resident memory grew {grown:.1f} MB over {CALLS - warm} calls"
