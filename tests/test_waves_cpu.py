"""The CPU's ``waves_varlen`` entry point (``mlir_templates.unit_waves``: group mode's short and
middling sequences in one call, every sequence's 64-row slots advancing one 64-key chunk per
step), checked against the float64 group-mode reference.

Covered: many sequences with tails of 1..63 rows past a slot and keys past a chunk, Sq != Sk per
sequence under every mask kind (slots that see no key, rows that see none), zero-length q or k,
sequences of a few queries (``rows_packed``) among them, padded starts and ``seqlen_k``, GQA / MQA,
f32 / f16 / bf16, Dq != Dv, LSE; NaN in one sequence's keys and values reaching no other
sequence; one call per problem; a long sequence beside short ones (one ``units_varlen`` call and
one ``waves_varlen`` call), interleaved or not: each sequence takes the call its own length
chooses (group mode is batch invariant).
"""

import pytest
import torch

import fmha_iree
from fmha_iree.paths import policy
from reference import seed_of
from test_units_varlen_cpu import GQA_CASES, GQA_IDS, MASKS, check_gqa, check_nan_isolation, check_padded, spy_tables
from test_varlen import check_varlen, packed, starts

# (id, query lengths, key lengths): tails past 64-row slots and 64-key chunks, Sq != Sk both
# ways, a few-query sequence (rows_packed) and zero-length q and k among them
SEQS = [
    ("short", [64, 1, 65, 127, 33, 200], [64, 1, 65, 127, 33, 200]),
    ("sq-ne-sk", [10, 130, 64, 0, 90, 255, 3], [300, 40, 64, 7, 0, 256, 900]),
]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("name,lq,lk", SEQS, ids=[s[0] for s in SEQS])
def test_every_mask_one_call(monkeypatch, name, lq, lk, mask):
    waves, units = spy_tables(monkeypatch, "waves_varlen"), spy_tables(monkeypatch, "units_varlen")
    q, k, v = packed(seed_of("waves", name, mask), sum(lq), sum(lk))
    check_varlen(q, k, v, starts(lq), starts(lk), mask=mask, what=f"waves_varlen {name} {mask}")
    assert len(waves) == 1 and not units, f"{len(waves)} waves_varlen calls"


@pytest.mark.parametrize("dtype,hq,hk,dv", GQA_CASES, ids=GQA_IDS)
@pytest.mark.parametrize("mask", ["b", "t:50,0"])
def test_gqa_dtypes_head_dims(dtype, hq, hk, dv, mask):
    check_gqa("waves-gqa", [100, 5, 129, 40], [90, 300, 129, 41], dtype, hq, hk, dv, mask)


@pytest.mark.parametrize("mask", ["b", "0"])
def test_padded_starts_and_seqlen_k(mask):
    check_padded("waves-padded", [60, 3, 140], [70, 9, 200], [50, 9, 199], mask)


def test_nan_keys_stay_in_their_sequence():
    """Sequences 0 and 2's last chunks end next to sequence 1's keys."""
    check_nan_isolation("waves-nan", [100, 70, 90, 30])


@pytest.mark.parametrize("lq,calls", [([700] + [40] * 6, (1, 1)),  # apart: each kind its call
                                      ([40, 700, 40, 30, 300], (1, 1)),  # interleaved: still each its call
                                      ([40, 30, 300, 50, 60, 40, 70, 90], (0, 1))],  # none past WAVE_MAX_ROWS
                         ids=["apart", "interleaved-long", "interleaved-short"])
def test_long_and_short_sequences(monkeypatch, lq, calls):
    units, waves = spy_tables(monkeypatch, "units_varlen"), spy_tables(monkeypatch, "waves_varlen")
    q, k, v = packed(seed_of("waves-split", len(lq)), sum(lq), sum(lq))
    check_varlen(q, k, v, starts(lq), starts(lq), mask="b", what=f"split {lq}")
    assert (len(units), len(waves)) == calls
    assert 300 <= policy.WAVE_MAX_ROWS < 700


@pytest.mark.parametrize("mask", ["b", "t", "0", "b:40,0", "xb:9"])
@pytest.mark.parametrize("b,hq,hk,sq,sk", [(3, 4, 2, 200, 300), (2, 2, 2, 64, 64), (2, 2, 1, 130, 1024)],
                         ids=["gqa-200x300", "mha-64", "mqa-130x1024"])
def test_batch_mode_as_group_mode(monkeypatch, mask, b, hq, hk, sq, sk):
    """A bshd batch of middling lengths (no padding) runs as group mode: one waves_varlen call."""
    from common import check_fwd
    from reference import make_qkv

    calls = spy_tables(monkeypatch, "waves_varlen")
    q, k, v = make_qkv(seed_of("waves-batch-mode", mask, sq, sk), B=b, Hq=hq, Hk=hk, Sq=sq, Sk=sk, layout="bshd")
    r = fmha_iree.route(q, k, v, mask=mask, layout="bshd")
    assert (r.path, r.entry) == ("cpu_group", "waves_varlen"), r
    check_fwd(q, k, v, mask=mask, layout="bshd", what=f"batch as group mode {mask} {sq}x{sk}")
    assert len(calls) == 1
    assert policy.BATCH_WAVE_MIN_ROWS <= 64 and policy.BATCH_WAVE_MAX_KEYS >= 1024


@pytest.mark.parametrize("mask", ["b", "t:30,0", "0"])
@pytest.mark.parametrize("padded", [False, True], ids=["full", "cu_seqlen"])
def test_batch_mode_bhsd_as_group_mode(monkeypatch, mask, padded):
    """A bhsd batch of middling lengths, with or without cu_seqlen padding: one waves_varlen call
    on the batch as it lies (each batch entry a sequence of tokens b S + s)."""
    from common import check_fwd, cu
    from reference import make_qkv

    calls = spy_tables(monkeypatch, "waves_varlen")
    q, k, v = make_qkv(seed_of("waves-bhsd", mask, padded), B=3, Hq=4, Hk=2, Sq=150, Sk=260, layout="bhsd")
    kw = dict(cu_seqlen_q=cu([150, 0, 77]), cu_seqlen_k=cu([260, 9, 100])) if padded else {}
    r = fmha_iree.route(q, k, v, mask=mask, **kw)
    assert (r.path, r.entry) == ("cpu_group", "waves_varlen"), r
    check_fwd(q, k, v, mask=mask, what=f"bhsd batch as group mode {mask} padded={padded}", **kw)
    assert len(calls) == 1


def test_batch_mode_short_queries_keep_rows():
    q, k, v = (torch.randn(2, s, 2, 64) for s in (32, 300, 300))
    assert fmha_iree.route(q, k, v, mask="b", layout="bshd").path == "rows"
