"""Shared by the benchmark scripts: median wall time of a call after one warm-up call."""

import time


def median_time(fn, reps: int) -> float:
    fn()  # warm-up (compile / load)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]
