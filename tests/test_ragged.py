"""Ragged problems on the GPU paths (``paths.tiles``, ``paths.packed``, ``paths.ragged`` and the
frame they share, ``paths.frame``): group mode, batches with cu_seqlen padding and paged KV caches,
on the GPU module's formulation built for llvm-cpu (where CI runs) and driven through the paths
(``paths.run_group``, ``run_batch``, ``run_paged``), against the float64 reference.

Covered: many short and long sequences in one call, zero-length q or k, Sq != Sk per sequence
under every mask kind, seqlen_k, padded starts with NaN in the gaps, NaN in a batch's padding,
paged caches (pages in scattered order, partly filled last pages, page sizes 16 / 64, host arrays
and DeviceTensors), GQA / MQA with Dq != Dv, f32 / f16 / bf16, LSE. The interior / edge cut with
each sequence's own coordinates (``paths.frame.ragged_coords``) is checked against a brute-force
visibility count."""

import numpy as np
import pytest
import torch

from fmha_iree.runtime.device import DeviceTensor
from fmha_iree.problem.mask import Mask
from fmha_iree.paths import frame as frames, packed as packed_path, policy
from fmha_iree.paths.base import Refused
from fmha_iree.paths.tiles import TILES as TILES_PATH
from fmha_iree.problem.paged import check_paged
from fmha_iree.problem.spec import check_batch, check_varlen

from common import RAGGED_TILES, route, run_batch, run_group, run_paged
from reference import assert_close, attention_ref, seed_of, varlen_ref

TILES = RAGGED_TILES
MASKS = ["0", "b", "t", "b:20,0", "t:3,40", "b:0,0", "xb:9", "t:-1,5"]
TORCH = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(scope="module")
def module(ragged_module):
    return ragged_module


def _starts(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _group(mod, mask, lq, lk, *, hq=4, hk=2, dq=64, dv=64, dtype="f32", seqlen_k=None, pad_q=None, pad_k=None,
           what="", spare=1):
    """Run packed sequences of ``lq`` queries / ``lk`` keys (``pad_q`` / ``pad_k``: gaps before
    each sequence, filled with NaN; ``spare`` rows after the last) and compare with ``varlen_ref``."""
    g = torch.Generator().manual_seed(seed_of("ragged", what, mask))
    sq, sk = _starts(lq), _starts(lk)
    ppq = None if pad_q is None else _starts(np.asarray(lq) + pad_q)
    ppk = None if pad_k is None else _starts(np.asarray(lk) + pad_k)
    tq = int((ppq if ppq is not None else sq)[-1]) + 1
    tk = int((ppk if ppk is not None else sk)[-1]) + spare
    q, k, v = (torch.randn(t, h, d, generator=g).to(TORCH[dtype]) for t, h, d in ((tq, hq, dq), (tk, hk, dq), (tk, hk, dv)))
    for x, pp, lens, ss in ((q, ppq, lq, sq), (k, ppk, lk, sk), (v, ppk, lk, sk)):
        if pp is not None:  # NaN everywhere no sequence owns
            own = np.zeros(x.shape[0], bool)
            for b, n in enumerate(lens):
                own[pp[b] + np.arange(n)] = True
            x[torch.from_numpy(~own)] = float("nan")
    p, starts = check_varlen(q, k, v, sq, sk, seqlen_k=seqlen_k, seqstart_padded_q=ppq, seqstart_padded_k=ppk,
                             mask=mask, scale=None)
    assert mod.caps.has("fwd_ragged") and mod.caps.layout == "bshd"
    out, lse = run_group(mod, p, starts)
    ref_out, ref_lse = varlen_ref(q, k, v, sq, sk, seqlen_k=seqlen_k, mask=mask, seqstart_padded_q=ppq,
                                  seqstart_padded_k=ppk)
    assert_close(out, ref_out, TORCH[dtype], what=f"{what} {mask} out")
    assert_close(lse, ref_lse, TORCH[dtype], kind="lse", what=f"{what} {mask} lse")


COMPOSITIONS = [  # (id, query lengths, key lengths)
    ("mixed", [5, 130, 1, 77, 0, 200, 3], [9, 130, 300, 77, 4, 150, 0]),
    ("decode", [1] * 9, [1, 600, 64, 65, 2, 333, 0, 128, 17]),
    ("chunked", [64, 16, 100], [300, 16, 420]),
]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("name,lq,lk", COMPOSITIONS, ids=[c[0] for c in COMPOSITIONS])
def test_group_mode_every_mask(module, name, lq, lk, mask):
    _group(module(), mask, lq, lk, what=name)


def test_group_mode_many_sequences(module):
    rng = np.random.default_rng(7)
    lq = list(rng.integers(0, 40, 48)) + [400, 257]
    lk = [int(x) + int(rng.integers(0, 30)) for x in lq]
    for mask in ("b", "t:30,0"):
        _group(module(), mask, lq, lk, what="many")


@pytest.mark.parametrize("mask", ["b", "t:3,40", "0", "b:50,0"])
def test_group_mode_prefill_in_groups_of_rows(module, mask):
    """Long sequences in no order of length: the frame runs in several groups of rows, each
    computing only the leading entries of the frame ordered longest first (``Frame.by_length``,
    ``Frame.prefix``); the shortest, empty and longest sequences sit anywhere in the call."""
    lq = [130, 600, 5, 300, 0, 451, 64, 599, 1]
    lk = [130, 600, 40, 350, 9, 451, 64, 700, 300]
    _group(module(), mask, lq, lk, what="groups")


def test_frame_prefix_holds_every_entry_with_rows_past_it():
    """For every row ``a`` of a frame, the leading ``nb[a // U]`` entries include each entry with
    a query row at or past ``a`` (brute force over the rows), and ordering the frame by length
    moves every output row with its entry."""
    rng = np.random.default_rng(11)
    m = Mask.from_str("b")
    for _ in range(30):
        n = int(rng.integers(1, 40))
        lq = rng.integers(0, 300, n)
        lq[int(rng.integers(0, n))] = int(rng.integers(1, 300))
        st = _starts(lq)
        fr = frames.group_frame(m, (st[:-1], lq, st[:-1], lq, st[:-1], int(st[-1])), int(st[-1]))
        ordered = fr.by_length()
        ql = ordered.desc[:, 0]
        assert (np.diff(ql.astype(np.int64)) <= 0).all()
        unit, *nb = ordered.prefix()
        assert len(nb) == 16 and unit * 16 >= ordered.q_idx.shape[1]
        for a in range(ordered.q_idx.shape[1]):
            has_rows = np.flatnonzero(ql > a)
            assert (has_rows < nb[min(a // unit, 15)]).all()
        for f in (fr, ordered):  # each output row's frame row holds that row's source
            src = f.q_idx.ravel()[f.out_idx.ravel()]
            assert np.array_equal(src, np.arange(int(st[-1])))
            assert np.array_equal(f.q_idx.ravel()[f.lse_idx.ravel()], np.arange(int(st[-1])))


def test_group_mode_seqlen_k_and_padded_starts(module):
    lq, lk = [7, 0, 90, 33], [50, 20, 140, 33]
    used = np.array([50, 3, 100, 0], np.int32)
    _group(module(), "b", lq, lk, seqlen_k=used, pad_q=[2, 5, 0, 3], pad_k=[1, 0, 7, 2], what="padded")


@pytest.mark.parametrize("dtype,layout,group,dq,dv", [("bf16", "bshd", 1, 64, 64), ("f16", "bshd", 4, 64, 32),
                                                      ("f32", "bshd", 2, 96, 48)],
                         ids=["bf16-mha", "f16-mqa-dv32", "f32-gqa-padded-d96x48"])
def test_group_mode_dtypes_and_gqa(module, dtype, layout, group, dq, dv):
    """Also head dims run zero-padded (96 / 48 compute as 128 / 64 in the frame)."""
    mod = module(dtype, layout, group, dq, dv)
    hq, hk = (2, 2) if group == 1 else (4, 4 // group)
    for mask in ("b", "t:10,5", "0"):
        _group(mod, mask, [3, 100, 1, 64], [70, 100, 129, 200], hq=hq, hk=hk, dq=dq, dv=dv, dtype=dtype, what=dtype)


CU_PATHS = [(m, p) for m in ("b", "t:3,40", "0", "xb:9") for p in ("ragged", "tiles")]


@pytest.mark.parametrize("mask,path", CU_PATHS, ids=[f"{m}-{p}" for m, p in CU_PATHS])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_cu_seqlen_batch_one_frame(module, layout, mask, path, monkeypatch):
    """A batch with cu_seqlen padding routes to the frame (with ``fwd_tiles`` off) or, for the
    masks it takes, to ``fwd_tiles``; NaN in every padded row and key never reaches the result
    (the tiles' edge copies zero the keys past each entry's own); padded rows are 0 with LSE
    -inf."""
    if path == "ragged":
        monkeypatch.setattr(type(TILES_PATH), "plan", lambda self, prob, caps: Refused(("off in this test",)))
    mod = module("f32", layout, 2)
    g = torch.Generator().manual_seed(seed_of("ragged-batch", layout, mask))
    B, sq, sk = 3, 150, 220
    shape = lambda s, h: (B, h, s, 64) if layout == "bhsd" else (B, s, h, 64)  # noqa: E731
    q, k, v = torch.randn(*shape(sq, 4), generator=g), torch.randn(*shape(sk, 2), generator=g), torch.randn(*shape(sk, 2), generator=g)
    lq, lk = [150, 10, 140], [3, 220, 77]
    for b in range(B):
        for x, n in ((q, lq[b]), (k, lk[b]), (v, lk[b])):
            (x[b, :, n:] if layout == "bhsd" else x[b, n:])[...] = float("nan")
    cq, ck = _starts(lq), _starts(lk)
    p = check_batch(q, k, v, mask=mask, scale=None, layout=layout, cu_seqlen_q=cq, cu_seqlen_k=ck)
    assert route(mod, p).path == path
    out, lse = run_batch(mod, p)
    ref_out, ref_lse = attention_ref(q, k, v, mask=mask, layout=layout, cu_seqlen_q=cq, cu_seqlen_k=ck)
    assert_close(out, ref_out, torch.float32, what=f"{layout} {mask} out")
    assert_close(lse, ref_lse, torch.float32, kind="lse", what=f"{layout} {mask} lse")
    for b, n in enumerate(lq):
        rows = out[b, :, n:] if layout == "bhsd" else out[b, n:]
        assert (rows == 0).all() and torch.isneginf(lse[b, :, n:]).all()


def _paged_case(seed, lq, lk, page):
    rng = np.random.default_rng(seed)
    n_pages = sum(-(-n // page) for n in lk) + 3
    free = list(rng.permutation(n_pages))
    bt = np.full((len(lk), max(-(-n // page) for n in lk) + 1), -1, np.int32)
    for b, n in enumerate(lk):
        for i in range(-(-n // page)):
            bt[b, i] = free.pop()
    g = torch.Generator().manual_seed(seed)
    kc, vc = (torch.randn(n_pages, page, 2, 64, generator=g) for _ in range(2))
    q = torch.randn(max(sum(lq), 1), 4, 64, generator=g)
    return q, kc, vc, bt


def _paged_reference(q, kc, vc, sq, bt, lk, mask):
    """Each key read from its page in a Python loop, then packed for varlen_ref."""
    page = kc.shape[1]
    rows = [(int(bt[b, j // page]), j % page) for b in range(len(lk)) for j in range(int(lk[b]))]
    k = torch.stack([kc[p, r] for p, r in rows]) if rows else torch.zeros(0, 2, 64)
    v = torch.stack([vc[p, r] for p, r in rows]) if rows else torch.zeros(0, 2, 64)
    return varlen_ref(q, k, v, sq, _starts(lk), mask=mask)


PAGED = [("decode-p16", [1, 1, 1, 1], [40, 1, 17, 130], 16), ("prefill-p64", [30, 7, 0, 100], [30, 200, 5, 100], 64),
         ("empty-p16", [2, 0, 5], [0, 0, 33], 16)]


@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("name,lq,lk,page", PAGED, ids=[c[0] for c in PAGED])
def test_paged_cache_read_on_device(module, name, lq, lk, page, on_device):
    mod = module()
    q, kc, vc, bt = _paged_case(seed_of("ragged-paged", name), lq, lk, page)
    sq = _starts(lq)
    up = (lambda x: DeviceTensor.from_host(x.numpy(), "f32", "local-task")) if on_device else (lambda x: x)
    for mask in ("b", "t:5,3"):
        cache = check_paged(up(kc), up(vc), sq, None, np.array(lk, np.int32), None, bt)
        out, lse = run_paged(mod, up(q), cache, sq, mask=mask)
        out, lse = (x.to_numpy() if isinstance(x, DeviceTensor) else x for x in (out, lse))
        ref_out, ref_lse = _paged_reference(q, kc, vc, sq, bt, lk, mask)
        assert_close(out, ref_out, torch.float32, what=f"{name} {mask} out")
        assert_close(lse, ref_lse, torch.float32, kind="lse", what=f"{name} {mask} lse")


def _visible(mask: Mask, ql: int, kl: int) -> np.ndarray:
    y, x = mask.clipped_coords(ql, kl)
    i, j = np.arange(ql)[:, None], np.arange(kl)[None, :]
    return (j >= i - y + 1) & (j < np.minimum(i + x, kl))


@pytest.mark.parametrize("mask", MASKS)
def test_ragged_coords_bound_every_sequence(mask):
    """The frame's interior coordinates see only keys every valid row of every sequence sees;
    its union coordinates see every key some row sees (row by row, brute force)."""
    m = Mask.from_str(mask)
    rng = np.random.default_rng(3)
    for _ in range(20):
        n = int(rng.integers(1, 6))
        lq, lk = rng.integers(0, 60, n), rng.integers(0, 80, n)
        lq[0] = max(lq[0], 1)
        sq_f, sk_f = int(lq.max()), frames.frame_keys(max(int(lk.max()), 1))
        desc = np.array([(a, b, *m.clipped_coords(int(a), int(b))) for a, b in zip(lq, lk)], np.int32)
        y, x, yu, xu, khi, khiu = frames.ragged_coords(desc, sq_f, sk_f)
        s, j = np.arange(sq_f)[:, None], np.arange(sk_f)[None, :]
        lo = lambda yy: np.clip(s - yy + 1, 0, sk_f)  # noqa: E731
        hi = lambda xx, kh: np.minimum(np.clip(s + xx, 0, sk_f), kh)  # noqa: E731
        inner, outer = (j >= lo(y)) & (j < hi(x, khi)), (j >= lo(yu)) & (j < hi(xu, khiu))
        for (a, b) in zip(lq, lk):
            if a == 0:
                continue
            vis = np.zeros((sq_f, sk_f), bool)
            vis[:a, :b] = _visible(m, int(a), int(b))
            assert not (inner[:a] & ~vis[:a]).any(), f"{mask}: interior holds a key row {a}x{b} does not see"
            assert not (vis & ~outer).any(), f"{mask}: a key row {a}x{b} sees lies outside the union"


@pytest.mark.parametrize("mask", MASKS)
def test_descriptors_are_each_sequences_clipped_coords(mask):
    """The per-sequence descriptor rows, computed for all sequences at once, are each sequence's
    (qlen, klen) and ``Mask.clipped_coords`` for its own lengths (empty sequences included); the
    visibility they give is CK's rule for that sequence (``_visible`` from the reference's
    ``materialize``)."""
    m = Mask.from_str(mask)
    rng = np.random.default_rng(5)
    lq, lk = rng.integers(0, 90, 64), rng.integers(0, 120, 64)
    lq[:4], lk[:4] = [0, 1, 0, 90], [0, 0, 1, 1]
    desc = frames.descriptors(m, lq, lk)
    assert desc.shape == (64, 4) and desc.dtype == np.int32
    for (a, b), row in zip(zip(lq.tolist(), lk.tolist()), desc):
        assert tuple(row) == (a, b, *m.clipped_coords(a, b))
        y, x = int(row[2]), int(row[3])
        i, j = np.arange(a)[:, None], np.arange(b)[None, :]
        assert np.array_equal((j >= i - y + 1) & (j < np.minimum(i + x, b)), m.materialize(a, b))
    assert frames.descriptors(m, np.zeros(0, np.int64), np.zeros(0, np.int64)).shape == (0, 4)


def test_frame_keys_round_up_in_few_steps():
    """A frame holds every key of its longest sequence and at most 1/16 more (short ones exactly);
    key counts growing by one per call (a decode loop) make a new frame size rarely."""
    for n in range(1, 20000):
        f = frames.frame_keys(n)
        assert n <= f <= max(n, n + n // 16), n
    assert frames.frame_keys(64) == 64 and frames.frame_keys(0) == 0
    assert len({frames.frame_keys(n) for n in range(4000, 4256)}) == 2
    lq, lk = np.ones(3, np.int64), np.array([100, 5000, 7])
    fr = frames.group_frame(Mask.from_str("b"), (_starts(lq)[:-1], lq, _starts(lk)[:-1], lk, _starts(lq)[:-1], 3), 3)
    assert fr.sk_f == frames.frame_keys(5000) > 5000 and fr.page == 5000


@pytest.fixture
def packed_calls(monkeypatch):
    """The pieces every ``packed`` plan of the test chose (``paths.packed``'s ``packed_pieces`` /
    ``page_pieces`` / ``gathered_pieces``)."""
    seen = []
    for name in ("packed_pieces", "page_pieces", "gathered_pieces"):
        def spy(*a, real=getattr(packed_path, name), **kw):
            seen.append(real(*a, **kw))
            return seen[-1]
        monkeypatch.setattr(packed_path, name, spy)
    return seen


PACKED = [  # (id, query lengths, key lengths)
    ("decode", [1] * 9, [1, 600, 64, 65, 2, 333, 0, 128, 17]),
    ("speculative-2", [2, 2, 1, 2, 0], [300, 2, 513, 40, 7]),
    ("one-piece", [1, 1, 1], [30, 1, 33]),
]


@pytest.mark.parametrize("mask", ["0", "b", "t:20,0", "b:0,0", "xb:9", "t:-1,5"])
@pytest.mark.parametrize("name,lq,lk", PACKED, ids=[c[0] for c in PACKED])
def test_decode_reads_keys_in_place(module, packed_calls, name, lq, lk, mask):
    """Decode-shaped group mode whose keys are the rows of K / V goes through ``fwd_packed`` (K / V
    read where they lie, pieces of W rows, a tail piece for rows past the last whole one): every
    mask, zero-length sequences, two query rows, fewer keys than one piece."""
    _group(module(), mask, lq, lk, what=f"packed-{name}", spare=0)
    assert packed_calls and all(p.on for p in packed_calls)


@pytest.mark.parametrize("mask", ["b", "t:20,0", "0"])
def test_decode_with_gaps_gathers_its_keys(module, packed_calls, mask):
    """seqlen_k shorter than a sequence's run, gaps between runs and a spare row (all NaN): the
    runs are not read in place; their keys are gathered as pages (unused rows zeroed) for the
    pieces (``fwd_packed_paged``)."""
    used = np.array([90, 257, 0, 1, 33], np.int32)
    _group(module(), mask, [1, 1, 0, 1, 1], [90, 400, 30, 260, 70], seqlen_k=used, pad_k=[5, 0, 3, 100, 1],
           what="gaps")
    assert packed_calls and not packed_calls[0].on  # in place refused
    assert packed_calls[-1].on and packed_calls[-1].pages is not None and packed_calls[-1].page == policy.GATHER_PAGE


def test_gathered_pages_rounded_up(module, packed_calls):
    """Over 64 gathered pages, spare zero pages round the gathered buffer up (``frames.frame_keys``'
    rounding: a decode loop's sizes repeat); no piece reads them as keys."""
    used = np.array([1500, 2050, 900, 1201], np.int32)  # 24 + 33 + 15 + 19 = 91 pages of 64 rows
    _group(module(), "b", [1, 1, 2, 1], [1600, 2100, 901, 1300], seqlen_k=used, what="spare-pages", spare=3)
    pb, pv, _ = packed_calls[-1].pages
    assert len(pb) == frames.frame_keys(91) > 91 and not pv[91:].any()


def test_decode_reads_keys_in_place_gqa_f16(module, packed_calls):
    mod = module("f16", "bshd", 4, 64, 32)
    for mask in ("b", "t:10,5"):
        _group(mod, mask, [1] * 6, [700, 3, 256, 1, 90, 1000], hq=8, hk=2, dq=64, dv=32, dtype="f16", what="packed-f16",
               spare=0)
    assert packed_calls and all(p.on for p in packed_calls)


def test_packed_pieces_refuse_what_the_path_cannot_read():
    """Keys out of sequence order, a query tile too tall, or more sequences in a piece than its
    slots at every width leave the frame path in charge; a sparse cache too."""
    m = Mask.from_str("b")

    def frame(lq, lk, k_start):
        lq, lk = np.array(lq), np.array(lk)
        return frames.group_frame(m, (_starts(lq)[:-1], lq, np.array(k_start), lk, _starts(lq)[:-1], int(lq.sum())),
                                  int(lq.sum()))
    ok = packed_path.packed_pieces(frame([1, 1], [300, 300], [0, 300]), 600, 4)
    assert ok.on and ok.scalars == (256, 2, 0, 4) and list(ok.first) == [0, 0, 1]  # piece 1 holds both
    narrow = packed_path.packed_pieces(frame([1] * 6, [40] * 6, list(range(0, 240, 40))), 240, 4)
    assert narrow.on and narrow.scalars[0] == 128  # 256 rows would hold 7 sequences, 4 slots
    assert not packed_path.packed_pieces(frame([1, 1], [300, 300], [300, 0]), 600, 4).on  # out of order
    assert not packed_path.packed_pieces(frame([5, 1], [300, 300], [0, 300]), 600, 4).on  # 5 * 4 rows > 16
    assert not packed_path.packed_pieces(frame([1] * 40, [2] * 40, list(range(0, 80, 2))), 80, 4).on  # 32 in 64 rows
    assert not packed_path.packed_pieces(frame([1, 1], [64, 64], [0, 100]), 164, 4).on  # a gap
    assert not packed_path.packed_pieces(frame([1, 1], [64, 64], [0, 64]), 129, 4).on  # a spare row
    assert not packed_path.packed_pieces(frame([1, 1], [30, 20], [0, 30]), 50, 4).on  # fewer rows than a piece


def test_page_pieces_group_four_owned_sub_pages():
    """``fwd_packed_pages``' tables: per sequence, the 64-row sub-pages before its last in groups of
    four (a short group repeats its first), numbered as 64-row sub-pages of the cache; then one
    tail per sequence: its last sub-page's first row and the rows it uses (written out by hand
    from the block table, page 128)."""
    lq, lk, page = np.array([1, 1, 1, 1]), np.array([600, 257, 64, 0]), 128
    bt = np.array([[7, 2, 9, 0, 4], [1, 8, 3, -1, -1], [6, -1, -1, -1, -1], [-1] * 5], np.int32)
    sq = _starts(lq)
    fr = frames.group_frame(Mask.from_str("b"), (sq[:-1], lq, np.zeros(4, np.int64), lk, sq[:-1], 4), 4,
                            pages=(frames.paged_bases(bt, page, lk), page))
    pc = packed_path.page_pieces(fr, group=2)
    sub = lambda b, j: int(bt[b, j // 2]) * 2 + j % 2  # noqa: E731  (sub-page j of sequence b)
    want = [[sub(0, j) for j in (0, 1, 2, 3)], [sub(0, j) for j in (4, 5, 6, 7)], [sub(0, 8)] * 4,
            [sub(1, j) for j in (0, 1, 2, 3)]]
    pid, last_pb, last_pv, starts = pc.pages
    assert pc.in_place and pc.scalars == (256, 4, 0, 1)
    assert pid.reshape(-1, 4).tolist() == want
    assert pc.first.tolist() == [0, 0, 0, 1, 0, 1, 2, 3]  # whole pieces, then one tail per sequence
    assert last_pb.tolist() == [sub(0, 9) * 64, sub(1, 4) * 64, sub(2, 0) * 64, 0]
    assert last_pv.tolist() == [600 - 9 * 64, 1, 64, 0]
    assert starts.tolist() == [0, 3 * 256, 4 * 256, 4 * 256]


@pytest.mark.parametrize("page", [16, 64, 128])
def test_paged_decode_reads_pages_as_pieces(module, packed_calls, page):
    """A paged decode whose page is a multiple of 64 keys goes through ``fwd_packed_pages`` (the
    cache's pages read in place, each sequence's last page copied), smaller pages through
    ``fwd_packed_paged`` (its pages gathered in sequence order); either way the unused end of
    each last page (NaN here, as are the free pages) is zeroed, never read."""
    mod = module()
    # 600 and 257 keys: whole pieces of four sub-pages and of one (its group padded, masked)
    lq, lk = [1, 2, 1, 1, 1, 1, 1, 1], [40, 1, 17, 130, 0, 128, 600, 257]
    q, kc, vc, bt = _paged_case(seed_of("packed-paged", page), lq, [max(n, 1) for n in lk], page)
    own = np.zeros(kc.shape[:2], bool)
    for b, n in enumerate(lk):
        for j in range(n):
            own[bt[b, j // page], j % page] = True
    kc[torch.from_numpy(~own)] = float("nan")
    vc[torch.from_numpy(~own)] = float("nan")
    sq = _starts(lq)
    for mask in ("b", "t:5,3", "0"):
        cache = check_paged(kc, vc, sq, None, np.array(lk, np.int32), None, bt)
        out, lse = run_paged(mod, q, cache, sq, mask=mask)
        ref_out, ref_lse = _paged_reference(q, kc, vc, sq, bt, lk, mask)
        assert_close(out, ref_out, torch.float32, what=f"paged p{page} {mask} out")
        assert_close(lse, ref_lse, torch.float32, kind="lse", what=f"paged p{page} {mask} lse")
    chosen = [p for p in packed_calls if p.on]
    assert len(chosen) == 3 and all(p.pages is not None and p.in_place == (page % 64 == 0) for p in chosen)
    assert all(p.page == (64 if p.in_place else page) for p in chosen)
