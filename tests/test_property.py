"""Property-based: Hypothesis draws shapes, lengths, masks, layouts, GQA ratios and padding; every
drawn call must match the float64 reference (``reference.attention_ref`` / ``varlen_ref``).

Draws are derandomized (the same examples on every run, so CI is reproducible) and limited to
kernel keys the other test files compile (f32 d64: g1 bhsd, g1 bshd, g2 bhsd, g4 bhsd, and the
group-mode key g2 bshd; f16 and bf16 d64 g1 bhsd, ``test_dtypes``), so the examples add calls, not
compiles.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fmha_iree
from reference import assert_close, attention_ref, make_qkv, seed_of, varlen_ref

D = 64
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
# (layout, Hq // Hk, dtype) whose d64 modules other tests build
BATCH_KEYS = [("bhsd", 1, torch.float32), ("bshd", 1, torch.float32), ("bhsd", 2, torch.float32),
              ("bhsd", 4, torch.float32), ("bhsd", 1, torch.float16), ("bhsd", 1, torch.bfloat16)]

side = st.one_of(st.just(-1), st.integers(0, 8), st.integers(9, 300))
masks = st.one_of(
    st.sampled_from(["0", "t", "b"]),
    st.builds(lambda c, l, r: f"{c}:{l},{r}", st.sampled_from("tb"), side, side),
    st.builds(lambda c, w: f"{c}:{w}", st.sampled_from(["xt", "xb"]), st.integers(1, 80)),
)
length = st.one_of(st.integers(1, 8), st.integers(9, 200))


@st.composite
def padding(draw, batch: int, full: int):
    """None, or int32 cumulative lengths ``[B+1]`` of per-batch lengths within ``full``."""
    if not draw(st.booleans()):
        return None
    lens = draw(st.lists(st.integers(0, full), min_size=batch, max_size=batch))
    return torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)


@st.composite
def batch_problems(draw):
    layout, group, dtype = draw(st.sampled_from(BATCH_KEYS))
    b, hk = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    sq, sk = draw(length), draw(length)
    kw = dict(mask=draw(masks), layout=layout, cu_seqlen_q=draw(padding(b, sq)), cu_seqlen_k=draw(padding(b, sk)))
    if draw(st.booleans()):
        kw["scale"] = draw(st.floats(0.01, 0.5))
    return dict(B=b, Hq=hk * group, Hk=hk, Sq=sq, Sk=sk, layout=layout, dtype=dtype), kw


@SETTINGS
@given(batch_problems())
def test_batch_mode_matches_reference(problem):
    shape, kw = problem
    q, k, v = make_qkv(seed_of("prop", shape, kw["mask"]), Dq=D, **shape)
    out, lse = fmha_iree.fmha_fwd(q, k, v, return_lse=True, **kw)
    ref_out, ref_lse = attention_ref(q, k, v, **kw)
    what = f"{shape} {kw}"
    assert_close(out, ref_out, shape["dtype"], kind="out", what=what)
    assert_close(lse, ref_lse, shape["dtype"], kind="lse", what=what)


@st.composite
def varlen_problems(draw):
    n = draw(st.integers(1, 6))
    lq = draw(st.lists(st.one_of(st.just(0), length), min_size=n, max_size=n))
    lk = draw(st.lists(st.one_of(st.just(0), length), min_size=n, max_size=n))
    used = [draw(st.integers(0, x)) for x in lk] if draw(st.booleans()) else None
    gaps = draw(st.booleans())
    return lq, lk, used, gaps, draw(masks)


def _padded_starts(lengths, gap: int):
    """Physical starts with ``gap`` free rows before every sequence; total rows."""
    starts, at = [], 0
    for n in lengths:
        at += gap
        starts.append(at)
        at += n
    return torch.tensor(starts + [at], dtype=torch.int32), max(at, 1)


@SETTINGS
@given(varlen_problems())
def test_group_mode_matches_reference(problem):
    lq, lk, used, gaps, mask = problem
    cum = lambda x: torch.tensor(np.concatenate([[0], np.cumsum(x)]), dtype=torch.int32)  # noqa: E731
    pq, tq = _padded_starts(lq, 3 if gaps else 0)
    pk, tk = _padded_starts(lk, 5 if gaps else 0)
    q, k, v = make_qkv(seed_of("prop-varlen", lq, lk, mask), Hq=4, Hk=2, Sq=tq, Sk=tk, Dq=D, layout="bshd")
    q, k, v = q[0], k[0], v[0]
    kw = dict(mask=mask, seqlen_k=None if used is None else torch.tensor(used, dtype=torch.int32))
    if gaps:
        kw.update(seqstart_padded_q=pq, seqstart_padded_k=pk)
    out, lse = fmha_iree.fmha_fwd_varlen(q, k, v, cum(lq), cum(lk), return_lse=True, **kw)
    ref_out, ref_lse = varlen_ref(q, k, v, cum(lq), cum(lk), **kw)
    what = f"q{lq} k{lk} used={used} gaps={gaps} mask={mask}"
    assert_close(out, ref_out, torch.float32, kind="out", what=what)
    assert_close(lse, ref_lse, torch.float32, kind="lse", what=what)
