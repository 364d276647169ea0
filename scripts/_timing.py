"""Shared by the benchmark scripts: median wall time of a call after one warm-up call, and the
CUDA-event time of torch calls."""

import time


def median_time(fn, reps: int) -> float:
    fn()  # warm-up (compile / load)
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
