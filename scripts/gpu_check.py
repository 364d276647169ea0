#!/usr/bin/env python3
"""Correctness on a GPU of modules compiled elsewhere (``fmha-iree compile --target sm_80``),
through ``fmha_iree.load`` (only iree-base-runtime, numpy and torch needed there).

    python scripts/gpu_check.py gpu_modules/*.vmfb --device cuda://0

For every module: shapes that take the plan (odd lengths, windows) and shapes that take the one-call
dense / causal entry points (lengths multiples of the module's alignment), with host arrays, with
DeviceTensors and with torch CUDA tensors (non-contiguous views; the results must come back as
torch CUDA tensors), against a float64 reference computed from the inputs with the CK mask rule.
A ``bshd`` module also runs group mode (``varlen``): prefill frames of several groups of rows with
sequences in no order of length, empty ones, Sq != Sk, and a decode batch, from host arrays and
DeviceTensors (a first call, and a call that replays the plan of one on other tensors), against the
same reference per sequence; a decode batch from a paged cache (pages 16, 64 and 256 in a
shuffled order, every row no sequence owns NaN) on DeviceTensors; and batch invariance: a prefill
sequence and a decode sequence, alone and among other sequences (first, last), contiguous and
paged, must give bitwise the same rows, and so must a repeated call (``--invariance-only`` runs
just that; a difference is reported with its size, not raised).
"""

from __future__ import annotations

import argparse

import numpy as np


def main():
    import torch

    from fmha_iree import Mask
    from fmha_iree import load

    ap = argparse.ArgumentParser()
    ap.add_argument("modules", nargs="+")
    ap.add_argument("--device", default="cuda://0")
    ap.add_argument("--sources", nargs="+", default=["host", "device", "torch"], choices=("host", "device", "torch"),
                    help="inputs as host arrays, DeviceTensors, torch CUDA tensors (non-contiguous views)")
    ap.add_argument("--invariance-only", action="store_true", help="only the batch-invariance check (bshd modules)")
    args = ap.parse_args()
    worst = 0.0
    for path in args.modules:
        f = load(path, device=args.device)
        if args.invariance_only:
            if f.manifest["problem"]["layout"] == "bshd":
                _check_invariance(f, f.manifest["problem"], args.device)
            continue
        pr = f.manifest["problem"]
        d, g = pr["hdim"], pr["group"]
        dt = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[pr["dtype"]]
        print("module", f.manifest["module"], "tiles", f.manifest["tiles"]["ck"], "capabilities", f.capabilities)
        torch.manual_seed(0)
        cases = [(2, 77, 130, "b"), (1, 300, 300, "t"), (1, 1000, 1000, "0"), (1, 513, 700, "b:64,0"),
                 (2, 512, 1024, "0"), (2, 1024, 1024, "b"), (1, 2048, 2048, "t"), (1, 1024, 1024, "b:100,0"),
                 (2, 1024, 1024, "0"), (1, 1536, 1536, "b"), (1, 2048, 2048, "b:1000,0"), (1, 2048, 2048, "t:0,0"),
                 # windows a key band narrow enough for the banded path, Sq != Sk, Sk no multiple of 64
                 (2, 4096, 4096, "b:1024,0"), (1, 1500, 2048, "t:200,100"), (1, 3000, 4096, "b:500,20"),
                 (1, 4096, 2048, "b:300,0"), (1, 3000, 3000, "b:1024,0"), (2, 1000, 1001, "t:200,100"),
                 # decode and short queries (split-KV), keys too few for an aligned edge window
                 (3, 1, 4100, "b"), (2, 5, 777, "t"), (1, 3, 40, "0"), (2, 100, 60, "b")]
        hq = pr.get("heads") or 16
        for B, sq, sk, mask in cases:
            hk = hq // g
            q = torch.randn(B, hq, sq, d, dtype=dt)
            k = torch.randn(B, hk, sk, d, dtype=dt)
            v = torch.randn(B, hk, sk, d, dtype=dt)
            # the module's layout: bhsd as made above, bshd with S and H swapped (out too)
            lay = (lambda x: x) if pr["layout"] == "bhsd" else (lambda x: x.transpose(1, 2).contiguous())
            r = f.route(lay(q), lay(k), lay(v), mask=mask)
            path_kind = f"{r.path}:{r.entry or '-'}"
            vis = torch.from_numpy(Mask.from_str(mask).materialize(sq, sk))
            s = (q.double() @ k.double().repeat_interleave(g, 1).transpose(-1, -2)) / np.sqrt(d)
            s = s.masked_fill(~vis, float("-inf"))
            ref = torch.softmax(s, -1).nan_to_num(0) @ v.double().repeat_interleave(g, 1)
            rl = torch.logsumexp(s, -1)
            for src in args.sources:
                ins = _inputs(src, tuple(lay(x) for x in (q, k, v)), args.device)
                out, lse = f(*ins, mask=mask, return_lse=True)
                if src == "device":
                    out, lse = out.to_torch(), lse.to_torch()
                if src == "torch":  # torch CUDA tensors back, on the inputs' GPU
                    assert out.is_cuda and lse.is_cuda, (out.device, lse.device)
                    out, lse = out.cpu(), lse.cpu()
                err = (lay(out).double() - ref).abs().max().item()
                lerr = (lse.double() - rl).nan_to_num(0, 0, 0).abs().max().item()
                # without the LSE: compiled-in lengths take dense_o_s<S>
                out2 = f(*ins, mask=mask)
                out2 = out2.to_torch() if src == "device" else out2.cpu()
                err = max(err, (lay(out2).double() - ref).abs().max().item())
                if src == "device":  # a repeated call on DeviceTensors replays its prepared form
                    out3 = f(*ins, mask=mask, return_lse=True)[0].to_torch()
                    err = max(err, (lay(out3).double() - ref).abs().max().item())
                worst = max(worst, err)
                print(f"  {pr['dtype']} d{d} g{g} B={B} Sq={sq} Sk={sk} mask={mask:<8} path={path_kind:<12} {src:<6}: "
                      f"max|out-ref|={err:.2e} max|lse-ref|={lerr:.2e}", flush=True)
        if pr["layout"] == "bshd":
            worst = max(worst, _check_varlen(f, pr, dt, args.device))
            worst = max(worst, _check_paged(f, pr, dt, args.device))
            _check_invariance(f, pr, args.device)
    print(f"worst max|out-ref| {worst:.2e}")


# batch invariance: (target's query rows, keys) and its companions; the target alone, first and last
INVARIANCE = [((700, 700), [(64, 64)] * 20 + [(2048, 2048)]), ((1, 3000), [(1, n) for n in (40, 9000, 300, 5000)] * 8),
              ((1, 3000), [(64, 64), (1, 100), (2048, 2048)])]


def _check_invariance(f, pr, device: str):
    """The target's rows (out and LSE) alone and among companions, contiguous and from a paged
    cache (64-row pages), and a repeated call: bitwise the same where ``same`` says so."""
    import torch

    import fmha_iree

    d, g = pr["hdim"], pr["group"]
    hq = pr.get("heads") or 16
    hk = hq // g
    dt = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[pr["dtype"]]
    gen = torch.Generator().manual_seed(5)
    up = (lambda x: fmha_iree.to_device(x, device)) if f.capabilities.formulation == "gpu" else (lambda x: x)

    def host(x):
        return x.to_torch() if hasattr(x, "to_torch") else torch.as_tensor(np.asarray(x))
    for (tq, tk), others in INVARIANCE:
        target = [torch.randn(n, h, d, generator=gen).to(dt) for n, h in ((tq, hq), (tk, hk), (tk, hk))]
        comp = [[torch.randn(n, h, d, generator=gen).to(dt) for n, h in ((a, hq), (b, hk), (b, hk))] for a, b in others]
        results = {}
        for name, seqs, at in (("alone", [target], 0), ("first", [target] + comp, 0), ("last", comp + [target], len(comp))):
            lq, lk = [s[0].shape[0] for s in seqs], [s[1].shape[0] for s in seqs]
            sq, sk = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lq, lk))
            q, k, v = (up(torch.cat([s[i] for s in seqs])) for i in range(3))
            for paged in (False, True):
                if paged:
                    kc, vc, bt = _paged_copy([s[1] for s in seqs], [s[2] for s in seqs], 64)
                    args = (q, up(kc), up(vc), sq, None)
                    kw = dict(seqlen_k=np.array(lk, np.int32), block_table=bt)
                else:
                    args, kw = (q, k, v, sq, sk), {}
                r = f.route(*args[:3], seqstart_q=sq, seqstart_k=args[4], mask="b", **kw)
                runs = [f.varlen(*args, mask="b", return_lse=True, **kw) for _ in range(2)]
                rows = slice(int(sq[at]), int(sq[at + 1]))
                got = [(host(o)[rows].float(), host(l)[:, rows]) for o, l in runs]
                rep = all(torch.equal(a, b) for a, b in zip(got[0], got[1]))
                results[(name, paged)] = (got[0], r.path)
                base = results.get(("alone", paged))
                diff = max((a - b).abs().max().item() for a, b in zip(got[0], base[0]))
                print(f"  invariance {pr['dtype']} d{d} g{g} target {tq}x{tk} {name:<5} {'paged' if paged else 'packed'}"
                      f" ({len(seqs)} sequences, path {r.path}, alone {base[1]}): max|diff vs alone|={diff:.2e}"
                      f"{' bitwise' if diff == 0 else ''}; repeat {'bitwise' if rep else 'DIFFERS'}", flush=True)


def _paged_copy(ks, vs, page: int):
    """The sequences' keys / values in a cache of ``page``-row pages (in sequence order) and its
    block table."""
    import torch

    n = [-(-x.shape[0] // page) for x in ks]
    kc, vc = (torch.zeros((sum(n), page) + ks[0].shape[1:], dtype=ks[0].dtype) for _ in range(2))
    bt = np.zeros((len(ks), max(n)), np.int32)
    at = 0
    for b, (kb, vb) in enumerate(zip(ks, vs)):
        bt[b, :n[b]] = np.arange(at, at + n[b])
        kc.view(-1, *kc.shape[2:])[at * page:at * page + kb.shape[0]] = kb
        vc.view(-1, *vc.shape[2:])[at * page:at * page + vb.shape[0]] = vb
        at += n[b]
    return kc, vc, bt


# group-mode compositions: (query lengths, key lengths); the first two are prefill frames of many
# groups of rows (their sequences in no order of length), the last a decode batch
VARLEN = [([1500, 130, 0, 2047, 700, 1, 2500, 333], [1500, 200, 9, 2047, 900, 64, 2500, 333]),
          ([64, 1024, 1023, 5, 257], [64, 1024, 3000, 5, 257]),
          ([1] * 12, [300, 4100, 1, 64, 65, 2000, 777, 8192, 17, 256, 1000, 5000])]


def _check_varlen(f, pr, dt, device: str) -> float:
    """Group mode on a bshd module against a float64 reference per sequence; the worst error."""
    import torch

    import fmha_iree
    from fmha_iree import Mask

    d, g = pr["hdim"], pr["group"]
    hq = pr.get("heads") or 16
    hk, worst = hq // g, 0.0
    for (lq, lk) in VARLEN:
        sq, sk = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lq, lk))
        q = torch.randn(int(sq[-1]), hq, d, dtype=dt)
        k, v = (torch.randn(int(sk[-1]), hk, d, dtype=dt) for _ in range(2))
        for mask in ("b", "t", "0", "b:64,0", "t:20,5"):
            ref = torch.zeros(q.shape, dtype=torch.float64)
            for b in range(len(lq)):
                qs, ks, vs = (x[a:z].double().transpose(0, 1) for x, a, z in
                              ((q, sq[b], sq[b + 1]), (k, sk[b], sk[b + 1]), (v, sk[b], sk[b + 1])))
                if not lq[b]:
                    continue
                s = (qs @ ks.repeat_interleave(g, 0).transpose(-1, -2)) / np.sqrt(d)
                s = s.masked_fill(~torch.from_numpy(Mask.from_str(mask).materialize(lq[b], lk[b])), float("-inf"))
                ref[sq[b]:sq[b + 1]] = (torch.softmax(s, -1).nan_to_num(0) @ vs.repeat_interleave(g, 0)).transpose(0, 1)
            for src in ("host", "device", "replay"):
                ins = (q, k, v) if src == "host" else tuple(fmha_iree.to_device(x, device) for x in (q, k, v))
                if src == "replay":  # the same metadata on other tensors first: this call replays its plan
                    f.varlen(*(fmha_iree.to_device(torch.zeros_like(x), device) for x in (q, k, v)), sq, sk, mask=mask)
                out = f.varlen(*ins, sq, sk, mask=mask)
                if src != "host":
                    out = out.to_torch()
                elif not isinstance(out, torch.Tensor):  # torch in, torch out (bf16 has no numpy type)
                    out = torch.as_tensor(np.asarray(out))
                err = (out.double() - ref).abs().max().item()
                worst = max(worst, err)
                print(f"  varlen {pr['dtype']} d{d} g{g} Tq={int(sq[-1])} Tk={int(sk[-1])} ({len(lq)} sequences) "
                      f"mask={mask:<7} {src:<6}: max|out-ref|={err:.2e}", flush=True)
    return worst


# a paged decode batch: query rows and key counts (many sub-pages, a partial group of them, one key, none)
PAGED = ([1, 1, 2, 1, 1, 1, 1, 1, 1], [600, 257, 256, 1, 0, 4100, 65, 1000, 63])


def _check_paged(f, pr, dt, device: str) -> float:
    """A decode batch from a paged cache whose free pages and unused rows hold NaN, against a
    float64 reference per sequence over its keys; the worst error."""
    import torch

    import fmha_iree
    from fmha_iree import Mask

    d, g = pr["hdim"], pr["group"]
    hq = pr.get("heads") or 16
    hk, worst, (lq, lk) = hq // g, 0.0, PAGED
    sq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    q = torch.randn(int(sq[-1]), hq, d, dtype=dt)
    # device arrays where the module reads a paged cache in place (fwd_ragged's family); a module
    # without it reads one from host arrays only
    on_device = "fwd_ragged" in f.manifest["entry_points"]
    for page in (16, 64, 256):
        n = [-(-x // page) for x in lk]
        perm = np.random.default_rng(page).permutation(sum(n) + 3)  # three free pages
        kc, vc = (torch.full((sum(n) + 3, page, hk, d), float("nan"), dtype=dt) for _ in range(2))
        bt = np.full((len(lk), max(n) + 1), -1, np.int32)
        keys = []
        for b, (x, nb) in enumerate(zip(lk, n)):
            bt[b, :nb] = perm[sum(n[:b]): sum(n[:b]) + nb]
            kb, vb = (torch.randn(x, hk, d, dtype=dt) for _ in range(2))
            for j in range(x):
                kc[bt[b, j // page], j % page], vc[bt[b, j // page], j % page] = kb[j], vb[j]
            keys.append((kb, vb))
        ins = tuple(fmha_iree.to_device(x, device) for x in (q, kc, vc)) if on_device else (q, kc, vc)
        for mask in ("b", "0", "t:20,5"):
            out = f.varlen(*ins, sq, None, seqlen_k=np.array(lk, np.int32), block_table=bt, mask=mask)
            out = out.to_torch() if on_device else out
            ref = torch.zeros(q.shape, dtype=torch.float64)
            for b, (kb, vb) in enumerate(keys):
                if not lq[b]:
                    continue
                qs, ks, vs = (x.double().transpose(0, 1) for x in (q[sq[b]:sq[b + 1]], kb, vb))
                s = (qs @ ks.repeat_interleave(g, 0).transpose(-1, -2)) / np.sqrt(d)
                s = s.masked_fill(~torch.from_numpy(Mask.from_str(mask).materialize(lq[b], lk[b])), float("-inf"))
                ref[sq[b]:sq[b + 1]] = (torch.softmax(s, -1).nan_to_num(0) @ vs.repeat_interleave(g, 0)).transpose(0, 1)
            err = (out.double() - ref).abs().max().item()
            err = float("inf") if out.isnan().any() else err
            worst = max(worst, err)
            print(f"  paged {pr['dtype']} d{d} g{g} page={page} Tk={sum(lk)} ({len(lk)} sequences) mask={mask:<7}: "
                  f"max|out-ref|={err:.2e}", flush=True)
    return worst


def _inputs(src: str, xs: tuple, device: str) -> tuple:
    """The inputs as host tensors, DeviceTensors, or torch CUDA tensors that are non-contiguous
    views (the same values; fmha_iree makes them contiguous on the GPU)."""
    import fmha_iree

    if src == "host":
        return xs
    if src == "device":
        return tuple(fmha_iree.to_device(x, device) for x in xs)
    gpu = f"cuda:{device.split('://')[-1] or 0}"
    return tuple(x.to(gpu).transpose(1, 2).contiguous().transpose(1, 2) for x in xs)


if __name__ == "__main__":
    main()
