"""The rows of scripts/bench_varlen.py's presets and the data of a row (packed q / k / v, a paged
cache), shared by ours and torch's side."""

from __future__ import annotations

import math

import numpy as np
from _varlen_peers import _starts

PAGE = 64  # the paged rows' page size


def case(label, q_lens, k_lens, hq, hk, d, dtype, *, mask="b", paged=0, ref=None, mode="varlen"):
    """One row: sequences of ``q_lens`` queries and ``k_lens`` keys; ``paged``: the page size of a
    paged KV cache (0: packed K/V); ``mode`` "varlen" (group mode), "padded" (batch mode on the
    batch padded to its longest sequence) or "cu_seqlen" (that batch with cu_seqlen_q / cu_seqlen_k
    giving each row's lengths); ``ref``: the label of the row it is compared with."""
    return dict(label=label, q_lens=[int(x) for x in q_lens], k_lens=[int(x) for x in k_lens], Hq=hq, Hk=hk, D=d,
                dtype=dtype, mask=mask, paged=paged, ref=ref, mode=mode)


def presets(name: str, scale: float = 1.0, seed: int = 0) -> list[dict]:
    """The rows of a preset; lengths (not counts) multiplied by ``scale`` for a quick check."""
    rng = np.random.default_rng(seed)

    def lens(n, lo, hi):
        return [max(1, round(int(x) * scale)) for x in rng.integers(lo, hi + 1, n)]

    if name == "gpu":
        pre, kv = lens(16, 128, 2047), lens(32, 256, 8192)
        return [case("prefill 16 seqs", pre, pre, 16, 16, 128, "f16"),
                case("decode B32", [1] * 32, kv, 32, 8, 128, "f16"),
                case("decode B32 paged", [1] * 32, kv, 32, 8, 128, "f16", paged=PAGE, ref="decode B32"),
                case("decode B32, KV growing per call", [1] * 32, kv, 32, 8, 128, "f16", mode="growing",
                      ref="decode B32"),
                case("prefill 16 seqs paged", pre, pre, 16, 16, 128, "f16", paged=PAGE, ref="prefill 16 seqs"),
                case("prefill 16 seqs, padded batch + cu_seqlen", pre, pre, 16, 16, 128, "f16", mode="cu_seqlen",
                      ref="prefill 16 seqs"),
                case("decode B32, padded batch + cu_seqlen", [1] * 32, kv, 32, 8, 128, "f16", mode="cu_seqlen",
                      ref="decode B32"),
                case("prefill 16 seqs, window b:512,0", pre, pre, 16, 16, 128, "f16", mask="b:512,0")]
    if name == "cpu":
        pre, kv = lens(16, 128, 1023), lens(32, 256, 4096)
        long, short = max(1, round(2048 * scale)), max(1, round(64 * scale))
        mix = [long] + [short] * 32
        alone = f"mixed: 1 x {long} alone"
        tiny, mid = lens(32, 1, 128), lens(64, 200, 300)  # drawn after the others: their lengths stay
        return [case("prefill 16 seqs", pre, pre, 8, 8, 64, "f32"),
                case("prefill 32 seqs of 1..128", tiny, tiny, 8, 8, 64, "f32"),
                case("prefill 64 seqs of 200..300", mid, mid, 8, 8, 64, "f32"),
                case("decode B32", [1] * 32, kv, 32, 8, 64, "f32"),
                case("decode B32 paged", [1] * 32, kv, 32, 8, 64, "f32", paged=PAGE, ref="decode B32"),
                case("decode B32, KV growing per call", [1] * 32, kv, 32, 8, 64, "f32", mode="growing",
                      ref="decode B32"),
                case(alone, [long], [long], 8, 8, 64, "f32"),
                case(f"mixed: 1 x {long} + 32 x {short}", mix, mix, 8, 8, 64, "f32", ref=alone),
                case(f"mixed: padded to {long} (batch mode)", mix, mix, 8, 8, 64, "f32", mode="padded", ref=alone)]
    raise ValueError(f"unknown preset {name!r}")


def visible_pairs(mask: str, lq: int, lk: int) -> int:
    """Query-key pairs a sequence's mask lets through (CK's (y, x), row by row)."""
    from fmha_iree.problem.mask import Mask

    return Mask.from_str(mask).visible_pairs(lq, lk)


def case_data(c: dict, seed: int):
    """Packed q [Tq, Hq, D], k / v [Tk, Hk, D] (torch CPU), the same for every row of one
    composition and shapes; with ``paged`` also the cache: k_cache / v_cache [num_pages, page,
    Hk, D] (rows past a sequence's keys are random, so a kernel reading them would show),
    block_table int32 [B, max_pages] (pages in a shuffled order; entries past a sequence's last
    page are 0, a valid page, since torch's kernels are given the same table) and the flat row of
    each used key in the cache (for torch's gathers)."""
    import torch

    dt = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[c["dtype"]]
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(c["q_lens"]), sum(c["k_lens"])
    q = torch.randn(tq, c["Hq"], c["D"], generator=g).to(dt)
    k = torch.randn(tk, c["Hk"], c["D"], generator=g).to(dt)
    v = torch.randn(tk, c["Hk"], c["D"], generator=g).to(dt)
    d = dict(q=q, k=k, v=v)
    if c["paged"]:
        page = c["paged"]
        n = [math.ceil(lk / page) for lk in c["k_lens"]]
        perm = np.random.default_rng(seed + 1).permutation(sum(n))
        bt = np.zeros((len(n), max(n)), np.int32)
        kc = torch.randn(sum(n), page, c["Hk"], c["D"], generator=g).to(dt)
        vc = torch.randn(sum(n), page, c["Hk"], c["D"], generator=g).to(dt)
        rows, off, ks = [], 0, _starts(c["k_lens"])
        for b, (lk, nb) in enumerate(zip(c["k_lens"], n)):
            pages = perm[off: off + nb]
            off += nb
            bt[b, :nb] = pages
            flat = (pages[:, None] * page + np.arange(page)).reshape(-1)[:lk]
            kc.view(-1, c["Hk"], c["D"])[torch.from_numpy(flat)] = k[ks[b]: ks[b + 1]]
            vc.view(-1, c["Hk"], c["D"])[torch.from_numpy(flat)] = v[ks[b]: ks[b + 1]]
            rows.append(flat)
        d.update(k_cache=kc, v_cache=vc, block_table=bt, flat_rows=np.concatenate(rows))
    return d
