"""Shared by the benchmark scripts: median wall time of a call after one warm-up call, the
CUDA-event time of torch calls, device / host times of fmha_iree calls, and the rows written
as bench.json and bench.csv."""

import csv
import json
import statistics
import time
from pathlib import Path


def median_time(fn, reps: int, warmup: bool = True) -> float:
    """Median seconds of ``reps`` calls, after one warm-up call (compile / load) unless told not."""
    if warmup:
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def cuda_time(fn, reps: int, warmup: int = 1) -> float:
    """Seconds per call of ``reps`` back-to-back calls of a torch CUDA function (CUDA events)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / reps / 1e3


def _wait_last(res):
    """Wait for a call's result where it is still on its way (fmha_iree DeviceTensors); host
    results (torch / numpy) are ready when the call returns."""
    last = res[-1] if isinstance(res, tuple) else res
    if hasattr(last, "wait"):
        last.wait()


def device_time(fn, reps: int, blocks: int = 3) -> float:
    """Seconds per call of ``reps`` back-to-back calls of ``fn`` (best of ``blocks`` blocks), each
    block closed by a wait for its last result: fmha_iree GPU calls on DeviceTensors return before
    the GPU is done and queue on the device. One warm-up call first."""
    _wait_last(fn())
    best = float("inf")
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(reps):
            res = fn()
        _wait_last(res)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def torch_device_time(fn, reps: int, blocks: int = 3) -> float:
    """As :func:`device_time` for calls that return torch CUDA tensors (fmha_iree on torch
    tensors: the call may return before the GPU is done), each block closed by
    ``torch.cuda.synchronize()``."""
    import torch

    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def host_time(fn, reps: int) -> float:
    """Host seconds to issue one call of ``fn`` with the device idle: each call's issue timed on
    its own, then its result waited for (not counted); the median. (Issued back to back, a call
    longer on the device than on the host waits for room in the runtime's queue and its upload
    ring, which such a figure would count as the host's.)"""
    _wait_last(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        res = fn()
        times.append(time.perf_counter() - t0)
        _wait_last(res)
    return statistics.median(times)


def write_rows(out_dir, rows: list[dict]):
    """``rows`` as ``out_dir/bench.json`` and ``out_dir/bench.csv`` (one column per key of any
    row; list values JSON-encoded)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(rows, indent=2))
    keys = sorted({k for r in rows for k in r})
    with open(out / "bench.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows({k: (json.dumps(v) if isinstance(v, list) else v) for k, v in r.items()} for r in rows)
