"""torch's side of scripts/bench_varlen.py: the peers (a loop of SDPA over the sequences, SDPA on
the padded batch, varlen_attn, FlexAttention with a document mask) on the same data as ours."""

from __future__ import annotations

import inspect
import math

import numpy as np


def _starts(lens) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _sdpa_mask(mask: str, lq: int, lk: int):
    """How torch's SDPA takes the CK mask of one sequence: (is_causal, bool [lq, lk] or None)."""
    from fmha_iree.problem.mask import Mask

    vis = Mask.from_str(mask).materialize(lq, lk)
    if vis.all():
        return False, None
    if lq == lk and (vis == np.tril(np.ones((lq, lk), bool))).all():
        return True, None
    return False, vis


def _pad(x, lens, longest):
    """Packed [T, H, D] -> [B, longest, H, D] (bshd, zeros past each sequence)."""
    out = x.new_zeros(len(lens), longest, *x.shape[1:])
    for b, (s, n) in enumerate(zip(_starts(lens)[:-1].tolist(), lens)):
        out[b, :n] = x[s: s + n]
    return out


def _unpad(x, lens):
    """[B, S, H, D] -> packed [T, H, D] (the rows of each sequence)."""
    import torch

    return torch.cat([x[b, :n] for b, n in enumerate(lens)])


# ---------------------------------------------------------------------------------------------- torch


def _torch_peers(c: dict, d: dict, dev: str, cuda: bool):
    """[(name, fn, packed)]: fn() runs one peer on the row's data on ``dev`` (the timed call);
    packed(its result) is the output as packed rows [Tq, Hq, D] (not timed: the padded batch's
    output is unpadded for the diff only). The first is the SDPA loop (the reference)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend

    ql, kl, mask = c["q_lens"], c["k_lens"], c["mask"]
    gqa = c["Hq"] != c["Hk"]
    sq, sk = _starts(ql), _starts(kl)
    q = d["q"].to(dev)
    paged = bool(c["paged"])
    peers = []

    # --- a loop of SDPA over the sequences: [1, H, L, D] views of the packed tensors
    qs = [q[sq[b]: sq[b + 1]].transpose(0, 1).unsqueeze(0) for b in range(len(ql))]
    how = []
    for lq, lk in zip(ql, kl):
        causal, vis = _sdpa_mask(mask, lq, lk)
        how.append((causal, None if vis is None else torch.from_numpy(vis).to(dev)))
    if paged:
        kc, vc = d["k_cache"].to(dev), d["v_cache"].to(dev)
        page = c["paged"]
        pages = [torch.from_numpy(d["block_table"][b, : math.ceil(lk / page)].astype(np.int64)).to(dev)
                 for b, lk in enumerate(kl)]

        def kv(b):  # the sequence's pages gathered, then its keys
            n = kl[b]
            return (kc[pages[b]].flatten(0, 1)[:n].transpose(0, 1).unsqueeze(0),
                    vc[pages[b]].flatten(0, 1)[:n].transpose(0, 1).unsqueeze(0))
    else:
        k, v = d["k"].to(dev), d["v"].to(dev)
        ks = [k[sk[b]: sk[b + 1]].transpose(0, 1).unsqueeze(0) for b in range(len(kl))]
        vs = [v[sk[b]: sk[b + 1]].transpose(0, 1).unsqueeze(0) for b in range(len(kl))]

        def kv(b):
            return ks[b], vs[b]

    def loop():
        outs = []
        for b in range(len(ql)):
            kb, vb = kv(b)
            causal, m = how[b]
            o = F.scaled_dot_product_attention(qs[b], kb, vb, attn_mask=m, is_causal=causal, enable_gqa=gqa)
            outs.append(o[0].transpose(0, 1))
        return torch.cat(outs)
    peers.append(("sdpa_loop" + ("_gather" if paged else ""), loop, None))

    # --- SDPA on the batch padded to its longest sequence (packed K/V only)
    if not paged:
        mq, mk = max(ql), max(kl)
        qp = _pad(q, ql, mq).transpose(1, 2)
        kp, vp = (_pad(x, kl, mk).transpose(1, 2) for x in (k, v))
        if all(lq == lk for lq, lk in zip(ql, kl)) and all(h[0] for h in how):
            causal, m, be = True, None, "flash"   # right padding: real rows see real keys only
        else:
            causal, m, be = False, torch.zeros(len(ql), 1, mq, mk, dtype=torch.bool), "efficient"
            for b, (lq, lk) in enumerate(zip(ql, kl)):
                _, vis = _sdpa_mask(mask, lq, lk)
                m[b, 0, :lq, :lk] = True if vis is None else torch.from_numpy(vis)
            if all(lq == 1 for lq in ql):
                m = m[:, :, :1]  # [B, 1, 1, Sk]: key padding
            m = m.to(dev)
        backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}[be] if cuda else None
        name = f"sdpa_padded_{be}" if cuda else "sdpa_padded"
        padded = _padded_fn(qp, kp, vp, m, causal, backend, gqa)
        if cuda and gqa:
            try:  # this backend may refuse enable_gqa: K/V heads repeated instead
                padded()
            except RuntimeError:
                g = c["Hq"] // c["Hk"]
                padded = _padded_fn(qp, kp.repeat_interleave(g, 1), vp.repeat_interleave(g, 1), m, causal, backend,
                                    False)
                name += "_kvrep"
        peers.append((name, padded, lambda o: _unpad(o.transpose(1, 2), ql)))

    if cuda:
        peers += [(n, f, None) for n, f in _varlen_peers(c, d, q, dev)]
        if not paged:
            peers.append(("flex", _flex_fn(c, q, k, v, dev), lambda o: o[0].transpose(0, 1)))
    return peers


def _padded_fn(qp, kp, vp, m, causal, backend, gqa):
    """SDPA on the padded batch ([B, H, S, D]) under the backend ``backend`` (None: torch's
    choice)."""
    import contextlib

    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    def run():
        with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            return F.scaled_dot_product_attention(qp, kp, vp, attn_mask=m, is_causal=causal, enable_gqa=gqa)
    return run


def _varlen_peers(c, d, q, dev):
    """torch.nn.attention.varlen.varlen_attn (FlashAttention, packed tokens as ours), adapted to the
    signature of this torch (is_causal in 2.9; window_size from 2.10; enable_gqa, seqused_k and
    block_table from 2.12): contiguous, or for a paged row through block_table and after a gather."""
    import torch

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as e:
        print(f"  torch varlen_attn: {e}")
        return []
    params = inspect.signature(varlen_attn).parameters
    ql, kl, mask = c["q_lens"], c["k_lens"], c["mask"]
    kw = {}
    if mask == "b":  # FlashAttention's causal is bottom-right aligned, as CK's "b"
        if "window_size" in params:
            kw["window_size"] = (-1, 0)
        else:
            kw["is_causal"] = True
    elif mask != "0":
        print(f"  torch varlen_attn: mask {mask!r} not mapped")
        return []
    gqa = c["Hq"] != c["Hk"]
    if gqa and "enable_gqa" in params:
        kw["enable_gqa"] = True
    cu_q = torch.from_numpy(_starts(ql)).to(dev)
    cu_k = torch.from_numpy(_starts(kl)).to(dev)
    mq, mk = max(ql), max(kl)
    g = c["Hq"] // c["Hk"]

    def with_heads(name, make):
        """A peer ``make(rep)``; where this torch has no enable_gqa, GQA heads are tried as they
        are (FlashAttention reads them natively) and repeated only if that fails (``_kvrep``)."""
        fn = make(1)
        if gqa and "enable_gqa" not in params:
            try:
                fn()
            except Exception:  # noqa: BLE001
                return name + "_kvrep", make(g)
        return name, fn

    peers = []
    if c["paged"]:
        kc, vc = d["k_cache"].to(dev), d["v_cache"].to(dev)
        if "block_table" in params:
            bt = torch.from_numpy(d["block_table"]).to(dev)
            used = torch.tensor(kl, dtype=torch.int32, device=dev)
            peers.append(("varlen_paged", lambda: varlen_attn(q, kc, vc, cu_q, cu_k, mq, mk, seqused_k=used,
                                                              block_table=bt, **kw)))
        flat = torch.from_numpy(d["flat_rows"]).to(dev)
        hk, dd = c["Hk"], c["D"]

        def gathered(rep):
            def run():
                k = kc.view(-1, hk, dd)[flat]
                v = vc.view(-1, hk, dd)[flat]
                if rep > 1:
                    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
                return varlen_attn(q, k, v, cu_q, cu_k, mq, mk, **kw)
            return run
        peers.append(with_heads("gather+varlen", gathered))
    else:
        k, v = d["k"].to(dev), d["v"].to(dev)

        def packed(rep):
            kr, vr = (k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)) if rep > 1 else (k, v)
            return lambda: varlen_attn(q, kr, vr, cu_q, cu_k, mq, mk, **kw)
        peers.append(with_heads("varlen", packed))
    return peers


def _flex_fn(c, q, k, v, dev):
    """FlexAttention (torch.compile) over the packed tokens as one [1, H, T, D] problem, with a
    BlockMask from the sequence ids: query token i sees key token j iff both are in sequence b and
    j's position is within i's CK window (y, x) for that sequence's lengths; blocks across
    sequences are skipped. Built (and compiled) on the first call."""
    import torch

    from fmha_iree.problem.mask import Mask

    ql, kl = c["q_lens"], c["k_lens"]
    m = Mask.from_str(c["mask"])
    yx = np.array([m.clipped_coords(lq, lk) for lq, lk in zip(ql, kl)], np.int64).reshape(-1, 2)
    q_doc = np.repeat(np.arange(len(ql)), ql)
    q_pos = np.arange(sum(ql)) - np.repeat(_starts(ql)[:-1], ql)
    k_doc = np.repeat(np.arange(len(kl)), kl)
    k_pos = np.arange(sum(kl)) - np.repeat(_starts(kl)[:-1], kl)
    q_doc_t, lo_t, hi_t, k_doc_t, k_pos_t = (torch.from_numpy(a).to(dev) for a in
                                             (q_doc, q_pos - yx[q_doc, 0] + 1, q_pos + yx[q_doc, 1], k_doc, k_pos))
    qf, kf, vf = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v))
    state = {}

    def run():
        if not state:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            def visible(b, h, qi, kj):
                kp = k_pos_t[kj]
                return (q_doc_t[qi] == k_doc_t[kj]) & (kp >= lo_t[qi]) & (kp < hi_t[qi])

            state["bm"] = create_block_mask(visible, B=None, H=None, Q_LEN=qf.shape[2], KV_LEN=kf.shape[2], device=dev)
            state["flex"] = torch.compile(flex_attention)
        return state["flex"](qf, kf, vf, block_mask=state["bm"], enable_gqa=qf.shape[1] != kf.shape[1])
    return run


# ---------------------------------------------------------------------------------------------- fmha_iree
