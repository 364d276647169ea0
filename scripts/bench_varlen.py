#!/usr/bin/env python3
"""Group mode (fmha_fwd_varlen) and the paged KV cache against torch, same inputs, same process:
time, TFLOP/s, decode GB/s, ratios (peer time / ours), agreement with a loop of torch SDPA.

CPU (compiles the group-mode modules on first use; a quick check: --scale 0.1):
    python scripts/bench_varlen.py --preset cpu [--reps 5] [--out DIR]
GPU (modules compiled here for $FMHA_IREE_CUDA_TARGET, e.g. sm_90, or `fmha-iree compile --layout bshd ...`
elsewhere into --modules):
    python scripts/bench_varlen.py --preset gpu --device cuda://0 [--modules gpu_modules] --out DIR

Rows (`--preset gpu`, f16 D128): 16 causal sequences of random lengths 128..2047 (seeded, about
17k tokens, H16); a decode batch (B32, one query each, KV lengths random in 256..8192, Hq32/Hk8);
the same decode from a paged KV cache (page 64, pages in a shuffled order); the decode as a loop
whose key lengths grow by one per call (``seqlen_k`` over the packed cache, 64 calls cycled up to
the row's lengths: a serving system's steady state, where each call is a new batch composition;
peers and the diff at the row's lengths); the 16-sequence
prefill from a paged cache; the prefill and the decode as padded batches in batch mode with
cu_seqlen_q / cu_seqlen_k (fmha_fwd). `--preset cpu` (f32 D64): 16 causal sequences 128..1023 (H8), 32 of 1..128 and 64 of 200..300, decode
B32 with KV 256..4096 (Hq32/Hk8), that decode paged and growing, and 1 x 2048 + 32 x 64 causal (H8) beside
the 1 x 2048 alone and the same batch padded to 2048 in batch mode (fmha_fwd). Every row's mask is
CK's "b" (bottom-right causal, per sequence).

Peers, on the same data: a loop of torch SDPA over the sequences (enable_gqa; is_causal where
Sq == Sk, else a bottom-right bool mask; Sq == 1 sees every key) -- also the reference of
`max_abs_diff`; torch SDPA on the batch padded to its longest sequence (is_causal for prefill, a
key-padding bool mask for decode; on CUDA the flash backend for causal, the efficient backend for
masks); on CUDA `torch.nn.attention.varlen.varlen_attn` (packed, as ours) and FlexAttention with a
document-causal BlockMask built from the sequence ids. Paged rows: the SDPA loop gathers each
sequence's pages; on CUDA varlen_attn reads the cache through its block_table (where this torch
takes it) and, apart, after a torch gather of the used rows ("gather+varlen").

`ratio_vs_<peer>` = peer time / ours (> 1: ours faster); `ratio_vs_ref` = the time of the row
named in `ref` / this row's (paged rows: our contiguous-cache row; the mixed rows: 1 x 2048 alone).
`compiles` counts fmha_iree compiles from a row's first call to its last timed call, after a
warm-up per module on another batch composition: it must be 0 (one module serves every batch).
On a GPU our inputs are uploaded once (`fmha_iree.to_device`), the calls issued back to back and
closed by a wait (best of 3 blocks); torch is timed with CUDA events. A paged cache that
fmha_iree refuses as DeviceTensors is passed as host arrays, and `inputs` says so (the time then
includes the host gather and the transfers). Writes a table to stdout and, with --out, bench.json
and bench.csv.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
from _timing import cuda_time, device_time, host_time, median_time, write_rows
from _varlen_cases import case_data, presets, visible_pairs
from _varlen_peers import _pad, _starts, _torch_peers, _unpad

HBM_TB_PER_S = 4.3  # the H200's HBM copy rate, the reference of the decode rows' GB/s
# the growing decode row's calls per cycle (key lengths from the row's minus 255 up to them, at least 1):
# more than the row makes, so that no composition repeats within it and none replays a prepared call
# (fmha_iree.runtime.prepared); a model's later layers in one decode step would
GROW = 256


def _find_module(folder, dtype, hdim, group, hq, hk):
    """A module of ``folder`` for group mode (bshd layout) with this dtype, head dim and group:
    one without compiled-in lengths first."""
    best = []
    for f in sorted(Path(folder).glob("*.json")):
        try:
            m = json.loads(f.read_text())
            pr = m["problem"]
        except (ValueError, KeyError, TypeError):
            continue
        if (pr.get("dtype"), pr.get("hdim"), pr.get("group"), pr.get("layout")) != (dtype, hdim, group, "bshd"):
            continue
        if pr.get("heads") not in (None, hq) or pr.get("kv_heads") not in (None, hk):
            continue
        best.append((bool((m["capabilities"].get("dense") or {}).get("seqlens")), f))
    return min(best)[1].with_suffix(".vmfb") if best else None


class Ours:
    """fmha_iree's calls for the rows: fmha_fwd_varlen / fmha_fwd, or a loaded module's varlen /
    batch call (``--modules``)."""

    def __init__(self, device, modules=None):
        self.device, self.modules, self.loaded = device, modules, {}
        self.gpu = not device.startswith("local")

    def _module(self, c):
        import fmha_iree

        key = (c["dtype"], c["D"], c["Hq"] // c["Hk"], c["Hq"], c["Hk"])
        if key not in self.loaded:
            path = _find_module(self.modules, *key)
            if path is None:
                raise LookupError(f"no bshd module for dtype {key[0]} hdim {key[1]} group {key[2]} in {self.modules}")
            print(f"  loading {path.name}")
            self.loaded[key] = fmha_iree.load(path, device=self.device)
        return self.loaded[key]

    def varlen(self, c, *args, **kw):
        import fmha_iree

        if self.modules:
            return self._module(c).varlen(*args, **kw)
        return fmha_iree.fmha_fwd_varlen(*args, device=self.device, **kw)

    def batch(self, c, q, k, v, **kw):
        import fmha_iree

        if self.modules:
            return self._module(c)(q, k, v, **kw)
        return fmha_iree.fmha_fwd(q, k, v, layout="bshd", device=self.device, **kw)

    def up(self, x):
        """On a GPU, the array uploaded once (a DeviceTensor); on the CPU the host array."""
        import fmha_iree

        return fmha_iree.to_device(x, self.device) if self.gpu else x

    def warm_up(self, c):
        """Compile / load the row's module on a small batch composition of its own."""
        import torch

        dt = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[c["dtype"]]
        q = torch.randn(3, c["Hq"], c["D"]).to(dt)
        k, v = (torch.randn(5, c["Hk"], c["D"]).to(dt) for _ in range(2))
        out = self.varlen(c, *(self.up(x) for x in (q, k, v)), np.array([0, 1, 3], np.int32),
                          np.array([0, 2, 5], np.int32), mask=c["mask"])
        if hasattr(out, "wait"):
            out.wait()

    def call(self, c, d):
        """(fn, inputs): fn() runs the row once; ``inputs`` says where the data lives."""
        sq, mask = _starts(c["q_lens"]), c["mask"]
        if c["mode"] in ("padded", "cu_seqlen"):
            mq, mk = max(c["q_lens"]), max(c["k_lens"])
            qp, kp, vp = (self.up(_pad(x, ln, m)) for x, ln, m in
                          ((d["q"], c["q_lens"], mq), (d["k"], c["k_lens"], mk), (d["v"], c["k_lens"], mk)))
            kw = dict(cu_seqlen_q=sq, cu_seqlen_k=_starts(c["k_lens"])) if c["mode"] == "cu_seqlen" else {}
            return (lambda: self.batch(c, qp, kp, vp, mask=mask, **kw)), "device" if self.gpu else "host"
        if c["mode"] == "growing":
            return self._growing(c, d), "device" if self.gpu else "host"
        if not c["paged"]:
            q, k, v = (self.up(d[n]) for n in "qkv")
            sk = _starts(c["k_lens"])
            return (lambda: self.varlen(c, q, k, v, sq, sk, mask=mask)), "device" if self.gpu else "host"
        lens = np.array(c["k_lens"], np.int32)
        bt = d["block_table"]

        def paged(q, kc, vc):
            return lambda: self.varlen(c, q, kc, vc, sq, None, seqlen_k=lens, block_table=bt, mask=mask)
        if self.gpu:
            fn = paged(*(self.up(d[n]) for n in ("q", "k_cache", "v_cache")))
            try:
                out = fn()
                if hasattr(out, "wait"):
                    out.wait()
                return fn, "device"
            except (TypeError, ValueError) as e:  # "a paged cache is read from host arrays ... for now"
                print(f"  fmha_iree paged cache as DeviceTensors: {str(e).splitlines()[0][:110]}; host arrays instead")
                return paged(d["q"], d["k_cache"], d["v_cache"]), "host (paged cache refused as DeviceTensors)"
        return paged(d["q"], d["k_cache"], d["v_cache"]), "host"

    def _growing(self, c, d):
        """A decode loop: each call sees one key more per sequence (``seqlen_k`` over the packed
        cache), over ``GROW`` calls cycled; ``fn(0)`` is the call at the row's key lengths."""
        q, k, v = (self.up(d[n]) for n in "qkv")
        sq, sk, full = _starts(c["q_lens"]), _starts(c["k_lens"]), np.array(c["k_lens"], np.int32)
        steps = itertools.cycle(range(GROW - 1, -1, -1))

        def fn(back=None):
            back = next(steps) if back is None else back
            return self.varlen(c, q, k, v, sq, sk, seqlen_k=np.maximum(full - back, 1), mask=c["mask"])
        return fn


def _to_torch(out):
    return out.to_torch() if hasattr(out, "to_torch") else out


# ---------------------------------------------------------------------------------------------- the run


def run(args) -> list[dict]:
    import torch

    gpu = not args.device.startswith("local")
    cuda = args.device.startswith("cuda") and torch.cuda.is_available()
    if args.device.startswith("cuda") and not cuda:
        print("# torch has no CUDA here: torch peers are not timed, the SDPA loop runs on the CPU for the diff only")
    dev = f"cuda:{args.device.split('://')[-1] or 0}" if cuda else "cpu"
    reps = args.reps or (20 if gpu else 5)
    ours = Ours(args.device, args.modules)
    cases = [c for c in presets(args.preset, args.scale, args.seed)
             if not args.label or any(w in c["label"] for w in args.label)]
    _warm_up(ours, cases)
    rows, by_label, data, peer_memo = [], {}, {}, {}
    for c in cases:
        dkey = (tuple(c["q_lens"]), tuple(c["k_lens"]), c["Hq"], c["Hk"], c["D"], c["dtype"], c["paged"])
        if dkey not in data:
            data = {dkey: case_data(c, args.seed)}  # one composition's data at a time
        d = data[dkey]
        timed = _time_ours(ours, c, d, gpu, reps)
        # torch on the same data (computed once per composition: the padded row shares the mixed row's)
        pkey = dkey + (c["mask"],)
        if pkey not in peer_memo:
            peer_memo.clear()
            peer_memo[pkey] = _time_peers(c, d, dev, (cuda, gpu), reps)
        res, ref = peer_memo[pkey]
        row = _row(c, d, timed, res, ref, by_label)
        rows.append(row)
        by_label[c["label"]] = row
        _print_row(row, res, gpu)
    return rows


def _warm_up(ours, cases):
    """One warm-up call per module our rows use (another batch composition), its compiles printed."""
    import fmha_iree

    warmed = set()
    for c in cases:
        key = (c["dtype"], c["D"], c["Hq"], c["Hk"], c["mask"])
        if key in warmed:
            continue
        before = dict(fmha_iree.cache_stats())
        t0 = time.perf_counter()
        ours.warm_up(c)
        after = fmha_iree.cache_stats()
        print(f"# warm-up {c['dtype']} D{c['D']} H{c['Hq']}/{c['Hk']} (2 sequences): {time.perf_counter() - t0:.1f} s, "
              f"{after['compiles'] - before['compiles']} compiles, {after['disk_hits'] - before['disk_hits']} disk hits",
              flush=True)
        warmed.add(key)


def _time_ours(ours, c, d, gpu, reps) -> dict:
    """Our row: its first call (a new batch composition) .. last timed call, compiles counted
    across; the output (unpadded for batch-mode rows) for the diff."""
    import fmha_iree

    c0 = fmha_iree.cache_stats()["compiles"]
    call, inputs = ours.call(c, d)
    last = {}

    def fn():
        last["out"] = call()
        return last["out"]
    if gpu:
        t, t_host = device_time(fn, reps), host_time(fn, reps)
    elif c["mode"] in ("padded", "cu_seqlen"):
        # batch mode on the padded batch is slow on the CPU (tens of seconds): half the calls, no
        # warm-up (the module is loaded; compiles still counted)
        t, t_host = median_time(fn, max(1, reps // 2), warmup=False), None
    else:
        t, t_host = median_time(fn, reps), None
    compiles = fmha_iree.cache_stats()["compiles"] - c0
    out = _to_torch(call(0) if c["mode"] == "growing" else last["out"])
    if c["mode"] in ("padded", "cu_seqlen"):
        out = _unpad(out, c["q_lens"])
    return dict(t=t, t_host=t_host, compiles=compiles, out=out, inputs=inputs)


def _time_peers(c, d, dev, devices, reps) -> tuple[dict, object]:
    """torch's peers on the row's data: {name: (seconds or None, max diff vs the first peer)} and
    the first peer's output (the SDPA loop: the reference of every diff). ``devices``: (torch has
    CUDA, ours runs on a GPU)."""
    cuda, gpu = devices
    res, ref = {}, None
    for name, pf, packed in _torch_peers(c, d, dev, cuda):
        try:
            o = pf()  # the first call: compiles (flex), checks
            o = packed(o) if packed else o
            if ref is None:
                ref, diff = o.float().cpu(), 0.0
            else:
                diff = (o.float().cpu() - ref).abs().max().item()
            if cuda:
                pt = cuda_time(pf, reps, warmup=1)
            elif gpu:
                pt = None  # a CPU peer against a GPU: not compared
            else:
                pt = median_time(pf, reps)
            res[name] = (pt, diff)
        except Exception as e:  # a peer this torch / device / shape does not take
            res[name] = (None, None)
            print(f"  torch {name}: {type(e).__name__}: {str(e).splitlines()[0][:110] if str(e) else ''}")
    return res, ref


def _row(c, d, timed, res, ref, by_label) -> dict:
    """The output row of case ``c``: ours, each peer's time and ratio, the row named in ``ref``."""
    ql, kl, t, t_host = c["q_lens"], c["k_lens"], timed["t"], timed["t_host"]
    err = (timed["out"].float().cpu() - ref).abs().max().item() if ref is not None else float("nan")
    flops = 4 * c["Hq"] * c["D"] * sum(visible_pairs(c["mask"], lq, lk) for lq, lk in zip(ql, kl))
    kv_bytes = 2 * sum(kl) * c["Hk"] * c["D"] * d["q"].element_size()
    row = dict(c)
    row.update(B=len(ql), T_q=sum(ql), T_k=sum(kl), max_q=max(ql), max_k=max(kl), inputs=timed["inputs"],
               fmha_iree_ms=t * 1e3, fmha_iree_tflops=flops / t / 1e12,
               kv_gb_per_s=kv_bytes / t / 1e9 if max(ql) == 1 else None,
               host_issue_ms=t_host * 1e3 if t_host is not None else None,
               compiles=timed["compiles"], max_abs_diff=err)
    for name, (pt, diff) in res.items():
        row[f"torch_{name}_ms"] = pt * 1e3 if pt else None
        row[f"ratio_vs_{name}"] = pt / t if pt else None
        row[f"torch_{name}_diff_vs_loop"] = diff
    best = min((pt for pt, _ in res.values() if pt), default=None)
    row["ratio_vs_best"] = best / t if best else None
    r = by_label.get(c["ref"]) if c["ref"] else None
    row["ref_ms"] = r["fmha_iree_ms"] if r else None
    row["ratio_vs_ref"] = r["fmha_iree_ms"] / row["fmha_iree_ms"] if r else None
    return row


def _shape(r) -> str:
    lens = "Sq1" if r["max_q"] == 1 else f"Tq{r['T_q']}"
    return (f"B={r['B']:<3} H={r['Hq']}/{r['Hk']:<3} {lens} Tk{r['T_k']} (max {r['max_k']}) D={r['D']} {r['dtype']} "
            f"mask={r['mask']}" + (f" page={r['paged']}" if r["paged"] else ""))


def _print_row(r, res, gpu):
    peers = "  ".join(f"{n} {r[f'torch_{n}_ms']:.3f} ms ({r[f'ratio_vs_{n}']:.2f}x)"
                      + (f" d{r[f'torch_{n}_diff_vs_loop']:.0e}" if r[f"torch_{n}_diff_vs_loop"] else "")
                      for n in res if r[f"torch_{n}_ms"])
    gbs = f" {r['kv_gb_per_s']:.4g} GB/s" if r["kv_gb_per_s"] else ""
    if r["kv_gb_per_s"] and gpu:
        gbs += f" ({r['kv_gb_per_s'] / (HBM_TB_PER_S * 1e3):.0%} of HBM)"
    ref = f" | vs {r['ref']!r} {r['ratio_vs_ref']:.2f}x" if r["ratio_vs_ref"] else ""
    host = f" (host issue {r['host_issue_ms']:.3f} ms)" if r["host_issue_ms"] is not None else ""
    print(f"{r['label']:<34} {_shape(r)}  [{r['inputs']}]\n"
          f"    fmha_iree {r['fmha_iree_ms']:9.3f} ms {r['fmha_iree_tflops']:.3g} TFLOP/s{gbs}{host} | {peers}"
          f" | best {r['ratio_vs_best'] or 0:.2f}x{ref} | compiles {r['compiles']} | diff {r['max_abs_diff']:.1e}",
          flush=True)


def _table(rows):
    """The summary: one line a row, ours in ms, every peer as its ratio (peer time / ours)."""
    peers = []
    for r in rows:
        peers += [k[len("ratio_vs_"):] for k in r if k.startswith("ratio_vs_") and k not in
                  ("ratio_vs_best", "ratio_vs_ref") and k[len("ratio_vs_"):] not in peers]
    w = max([len(r["label"]) for r in rows] + [5])
    cols = ["ms", "TFLOP/s", "GB/s"] + peers + ["vs ref", "compiles", "max diff"]
    widths = [max(8, len(x)) for x in cols]
    print("\n" + "label".ljust(w) + "  " + "  ".join(x.rjust(n) for x, n in zip(cols, widths)))

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)
    for r in rows:
        cells = [f(r["fmha_iree_ms"], ".3f"), f(r["fmha_iree_tflops"], ".3g"), f(r["kv_gb_per_s"], ".4g")]
        cells += [f(r.get(f"ratio_vs_{p}"), ".2f") for p in peers]
        cells += [f(r["ratio_vs_ref"], ".2f"), str(r["compiles"]), f(r["max_abs_diff"], ".1e")]
        print(r["label"].ljust(w) + "  " + "  ".join(x.rjust(n) for x, n in zip(cells, widths)))
    total = sum(r["compiles"] for r in rows)
    print(f"compiles during the timed calls, every row (after warm-up): {total}"
          + ("" if total == 0 else "  <-- a new batch composition compiled something"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=("cpu", "gpu"), help="default: cpu on local-task, else gpu")
    ap.add_argument("--device", default="local-task")
    ap.add_argument("--modules", help="folder of precompiled modules (bshd layout), picked by dtype/hdim/group")
    ap.add_argument("--reps", type=int, help="timed calls a row (default 5 on the CPU, 20 on a GPU)")
    ap.add_argument("--label", nargs="*", help="only rows whose label contains one of these words")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every sequence length (quick checks: 0.1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="folder for bench.json and bench.csv")
    args = ap.parse_args()
    if args.preset is None:
        args.preset = "cpu" if args.device.startswith("local") else "gpu"
    import torch

    try:
        from importlib.metadata import version

        iree = version("iree-base-runtime")
    except Exception:  # noqa: BLE001
        iree = "?"
    gpu_name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") and torch.cuda.is_available() else None
    flags = os.environ.get("IREE_PY_RUNTIME_FLAGS", "")
    target = {"cuda": "FMHA_IREE_CUDA_TARGET", "hip": "FMHA_IREE_HIP_TARGET"}.get(args.device.split(":")[0])
    if target and not args.modules:
        target = f"{target}={os.environ.get(target, '(default)')}"
    else:
        target = None
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M"), machine=f"{platform.node()} {platform.machine()} "
                f"{os.cpu_count()} cores", device=args.device + (f" ({gpu_name})" if gpu_name else ""),
                torch=torch.__version__, iree_runtime=iree, preset=args.preset, scale=args.scale, seed=args.seed)
    print(f"# {meta['date']} {meta['machine']} device={meta['device']} preset={args.preset} torch {torch.__version__} "
          f"iree-base-runtime {iree}" + (f" scale={args.scale}" if args.scale != 1 else "")
          + (f" IREE_PY_RUNTIME_FLAGS={flags!r}" if flags else "") + (f" {target}" if target else "")
          + (f" modules={args.modules}" if args.modules else ""))
    if args.preset == "gpu" or not args.device.startswith("local"):
        print(f"# reference: H200 HBM copy rate {HBM_TB_PER_S} TB/s (the decode rows' GB/s count the K+V bytes used)")
    rows = run(args)
    for r in rows:
        r.update(meta)
        if flags:
            r["iree_runtime_flags"] = flags
    if rows:
        _table(rows)
    if args.out:
        write_rows(args.out, rows)
        print(f"wrote {Path(args.out) / 'bench.json'} and {Path(args.out) / 'bench.csv'}")


if __name__ == "__main__":
    main()
