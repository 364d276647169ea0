"""Context-parallel (ring) attention over torch.distributed (``fmha_iree.integrations.distributed``), on the CPU
with ``gloo``: 2 and 4 ranks in child processes (one start per world size runs every case of
that size), a 1-rank group in this process; results against the float64 reference and against one
``fmha_fwd`` call over the whole sequence. The shard layout, the ring's block plan and the LSE merge
are tested on their own (no IREE).

Kernel key: f32, Hq=4 Hk=2 (GQA 2), D=32, bhsd, for every case (``bshd`` inputs too: the ring
computes in bhsd). The ``module`` fixture loads it here first (compiling it once into the disk
cache), so the ranks read it from the cache instead of each compiling it. The ``deployed`` fixture
compiles a module ahead of time (``fmha-iree compile``, ``bshd``, default mask ``b``) that the
ring is also given as ``module=`` (the deployment path: no compiler on the ranks).
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fmha_iree
from fmha_iree.integrations.distributed import (chunk_bounds, context_parallel_attention, gather_sequence, merge_attention,
                                   ring_blocks, shard_lengths, shard_sequence, unshard_sequence)
from reference import assert_close, attention_ref, make_qkv, seed_of

HEADS = dict(Hq=4, Hk=2, Dq=32)  # the one kernel key
F32 = torch.float32
# (name, S, causal, layout, B): S not a multiple of 2N in most; causal-S3 leaves rank 3 no positions
CASES = {
    2: [("causal-S37", 37, True, "bhsd", 1), ("full-S37", 37, False, "bhsd", 1),
        ("causal-S64-bshd-B2", 64, True, "bshd", 2)],
    4: [("causal-S50", 50, True, "bhsd", 1), ("full-S50-bshd", 50, False, "bshd", 1),
        ("causal-S3", 3, True, "bhsd", 1)],
}
SPAWN_TIMEOUT_S = 120


def _inputs(name: str, S: int, layout: str, B: int):
    return make_qkv(seed_of("cp", name), B=B, Sq=S, layout=layout, **HEADS)


def _seq_dim(layout: str) -> int:
    return 2 if layout == "bhsd" else 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# In the ranks (child processes)
# ---------------------------------------------------------------------------------------------
def _errors(rank: int, world: int) -> dict:
    """Arguments refused on every rank alike (no rank left waiting): a scale only rank 1 has, a
    bad head count only rank 1 has, and shard lengths that are not the load-balanced layout."""
    q, k, v = (shard_sequence(x, rank, world) for x in _inputs("err", 40, "bhsd", 1))
    got = {}
    calls = {
        "scale": lambda: context_parallel_attention(q, k, v, scale=0.5 if rank == 1 else None),
        "heads": lambda: context_parallel_attention(q[:, :3] if rank == 1 else q, k, v),
        "lengths": lambda: context_parallel_attention(*(x[:, :, :20 - 10 * rank] for x in (q, k, v))),
    }
    for what, call in calls.items():
        try:
            call()
            got[what] = None
        except ValueError as e:
            got[what] = str(e)
    return got


def _module_cases(rank: int, world: int, vmfb: str) -> dict:
    """The ring over a loaded module: causal and unmasked (the module's default mask is ``b``, so an
    unmasked block must pass its own), bhsd inputs into a bshd module."""
    f = fmha_iree.load(vmfb)
    got = {}
    for causal in (True, False):
        shards = [shard_sequence(x, rank, world) for x in _inputs("mod", 45, "bhsd", 1)]
        out, lse = context_parallel_attention(*shards, causal=causal, module=f, return_lse=True)
        got[causal] = dict(out=out, lse=lse)
    return got


def _rank_main(rank: int, world: int, port: int, out_dir: str, vmfb: str):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        results = {}
        for name, S, causal, layout, B in CASES[world]:
            dim = _seq_dim(layout)
            shards = [shard_sequence(x, rank, world, dim) for x in _inputs(name, S, layout, B)]
            out, lse = context_parallel_attention(*shards, causal=causal, layout=layout, return_lse=True)
            results[name] = dict(out=out, lse=lse, gathered=gather_sequence(out, dim=dim))
        if world == 2:
            results["errors"] = _errors(rank, world)
            results["module"] = _module_cases(rank, world, vmfb)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# In this process
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def module():
    """Load (on first use compile) the kernel every rank uses, before any rank starts."""
    q, k, v = _inputs("warm", 8, "bhsd", 1)
    fmha_iree.fmha_fwd(q, k, v, return_lse=True)


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """A host module compiled ahead of time for the kernel key, ``--layout bshd --mask b``."""
    vmfb = tmp_path_factory.mktemp("deployed") / "cp.vmfb"
    subprocess.run([sys.executable, "-m", "fmha_iree.cli", "compile", "--target", "host", "--dtype", "f32",
                    "--hdim", str(HEADS["Dq"]), "--heads", f"{HEADS['Hq']}:{HEADS['Hk']}", "--layout", "bshd",
                    "--mask", "b", "-o", str(vmfb)], check=True, capture_output=True)
    return str(vmfb)


@pytest.fixture(scope="module")
def spawned(module, deployed, tmp_path_factory):
    """``spawned(world)``: every rank's results of ``CASES[world]`` (one start per world size).
    The ranks are forked from a forkserver that imported torch and fmha_iree once (starting each
    rank as a fresh interpreter cost about 8 s for 4 ranks on a 2-core machine); the forkserver
    itself has run nothing, so the ranks open their own IREE devices."""
    cache = {}
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "fmha_iree.api", "fmha_iree.integrations.distributed",
                                            "reference", _rank_main.__module__])

    def run(world: int) -> list[dict]:
        if world not in cache:
            out_dir = tmp_path_factory.mktemp(f"cp{world}")
            ctx = mp.start_processes(_rank_main, args=(world, _free_port(), str(out_dir), deployed), nprocs=world,
                                     join=False, start_method="forkserver")
            deadline = time.monotonic() + SPAWN_TIMEOUT_S
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        p.kill()
                    pytest.fail(f"{world} ranks did not finish within {SPAWN_TIMEOUT_S} s")
            cache[world] = [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]
        return cache[world]

    return run


def _single(q, k, v, causal: bool, layout: str):
    """One fmha_fwd over the whole sequence (in bhsd: the same kernel key)."""
    if layout == "bshd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    out, lse = fmha_iree.fmha_fwd(q, k, v, mask="t" if causal else None, return_lse=True)
    return (out.transpose(1, 2) if layout == "bshd" else out), lse


@pytest.mark.parametrize("world,case", [(w, c) for w, cs in CASES.items() for c in cs],
                         ids=[f"N{w}-{c[0]}" for w, cs in CASES.items() for c in cs])
def test_ring_matches_reference_and_one_call(spawned, world, case):
    name, S, causal, layout, B = case
    ranks = spawned(world)
    dim = _seq_dim(layout)
    q, k, v = _inputs(name, S, layout, B)
    for r, res in enumerate(ranks):
        n = sum(shard_lengths(S, world)[r])
        assert res[name]["out"].dtype == F32 and res[name]["lse"].dtype == F32
        assert res[name]["out"].shape[dim] == n and tuple(res[name]["lse"].shape) == (B, HEADS["Hq"], n)
    out = unshard_sequence([res[name]["out"] for res in ranks], dim)
    lse = unshard_sequence([res[name]["lse"] for res in ranks], 2)
    ref_out, ref_lse = attention_ref(q, k, v, mask="t" if causal else None, layout=layout)
    assert_close(out, ref_out, F32, what=name)
    assert_close(lse, ref_lse, F32, kind="lse", what=name)
    one_out, one_lse = _single(q, k, v, causal, layout)
    assert_close(out, one_out.double().numpy(), F32, what=f"{name} vs one call")
    assert_close(lse, one_lse.double().numpy(), F32, kind="lse", what=f"{name} vs one call")
    for r, res in enumerate(ranks):
        assert torch.equal(res[name]["gathered"], out), f"gather_sequence on rank {r}"


def test_mismatched_arguments_raise_on_every_rank(spawned):
    errors = [res["errors"] for res in spawned(2)]
    for r, e in enumerate(errors):
        assert e["scale"] and "disagree on scale" in e["scale"] and "0.5" in e["scale"], (r, e)
        assert e["lengths"] and "load-balanced layout" in e["lengths"], (r, e)
    assert "multiple of k/v heads" in errors[1]["heads"]
    assert "ranks [1]" in errors[0]["heads"]


def test_ring_over_a_loaded_module(spawned):
    ranks = spawned(2)
    q, k, v = _inputs("mod", 45, "bhsd", 1)
    for causal in (True, False):
        out = unshard_sequence([res["module"][causal]["out"] for res in ranks])
        lse = unshard_sequence([res["module"][causal]["lse"] for res in ranks], 2)
        ref_out, ref_lse = attention_ref(q, k, v, mask="t" if causal else None)
        assert_close(out, ref_out, F32, what=f"module causal={causal}")
        assert_close(lse, ref_lse, F32, kind="lse", what=f"module causal={causal}")


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_no_group_is_a_value_error_naming_group():
    q, k, v = _inputs("nogroup", 8, "bhsd", 1)
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="group"):
        context_parallel_attention(q, k, v)


def test_one_rank_equals_fmha_fwd(module, world_of_one):
    q, k, v = _inputs("one", 37, "bhsd", 1)
    for causal in (True, False):
        out, lse = context_parallel_attention(q, k, v, causal=causal, return_lse=True)
        one_out, one_lse = _single(q, k, v, causal, "bhsd")
        assert_close(out, one_out.double().numpy(), F32, what=f"causal={causal}")
        assert_close(lse, one_lse.double().numpy(), F32, kind="lse", what=f"causal={causal}")
    assert isinstance(context_parallel_attention(q, k, v, scale=0.3), torch.Tensor)


def test_bad_arguments_name_the_argument(world_of_one):
    q, k, v = _inputs("bad", 8, "bhsd", 1)
    with pytest.raises(ValueError, match="layout"):
        context_parallel_attention(q, k, v, layout="bsdh")
    with pytest.raises(ValueError, match="k/v heads"):
        context_parallel_attention(q[:, :3], k, v)
    with pytest.raises(TypeError, match="dtype"):
        context_parallel_attention(q.double(), k.double(), v.double())
    with pytest.raises(TypeError, match="causal"):
        context_parallel_attention(q, k, v, causal=1)
    with pytest.raises(ValueError, match="4-D"):
        context_parallel_attention(q[0], k[0], v[0])


def test_one_rank_over_a_loaded_module(deployed, world_of_one):
    f = fmha_iree.load(deployed)
    for layout in ("bhsd", "bshd"):
        q, k, v = _inputs(f"one-mod-{layout}", 29, layout, 2)
        for causal in (True, False):
            out = context_parallel_attention(q, k, v, causal=causal, layout=layout, module=f)
            ref_out, _ = attention_ref(q, k, v, mask="t" if causal else None, layout=layout)
            assert_close(out, ref_out, F32, what=f"{layout} causal={causal}")
    with pytest.raises(ValueError, match="device"):
        context_parallel_attention(q, k, v, layout="bshd", module=f, device="local-task")
    with pytest.raises(TypeError, match="module"):
        context_parallel_attention(q, k, v, layout="bshd", module=deployed)
    with pytest.raises(TypeError, match="dtype"):
        context_parallel_attention(*(x.half() for x in (q, k, v)), layout="bshd", module=f)
    with pytest.raises(ValueError, match="head dims"):
        context_parallel_attention(q[..., :16], k[..., :16], v[..., :16], layout="bshd", module=f)


# ---------------------------------------------------------------------------------------------
# Layout, plan, merge (no IREE, no process group)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_unshard_round_trip(world):
    for S in (0, 1, 3, 7, 8, 37, 50):
        x = torch.arange(2 * S * 3).reshape(2, S, 3)
        chunks = torch.tensor_split(x, 2 * world, dim=1)
        assert [c.shape[1] for c in chunks] == [b - a for a, b in chunk_bounds(S, world)]
        shards = [shard_sequence(x, r, world, dim=-2) for r in range(world)]
        for r, s in enumerate(shards):
            assert torch.equal(s, torch.cat([chunks[r], chunks[2 * world - 1 - r]], 1))
        assert torch.equal(unshard_sequence(shards, dim=1), x)
    with pytest.raises(ValueError, match="shards\\[0\\]"):
        unshard_sequence([x[:, :2], x[:, :4]], dim=1)
    with pytest.raises(ValueError, match="rank"):
        shard_sequence(x, world, world, dim=1)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_blocks_cover_each_visible_pair_once(world, causal):
    """Over every (rank, source) step, the blocks' visible (query, key) pairs in global positions
    are the mask's pairs, each exactly once; nothing masked is computed as visible."""
    for S in (0, 1, 3, 7, 8, 37, 50):
        lengths = shard_lengths(S, world)
        pos = [shard_sequence(torch.arange(S), r, world, dim=0) for r in range(world)]
        seen = torch.zeros(S, S, dtype=torch.int64)
        for r in range(world):
            for src in range(world):
                for b in ring_blocks(r, src, lengths, causal):
                    vis = torch.ones(b.q1 - b.q0, b.k1 - b.k0, dtype=torch.int64)
                    if b.mask == "t":
                        vis = vis.tril()
                    else:
                        assert b.mask is None
                    seen[pos[r][b.q0:b.q1, None], pos[src][None, b.k0:b.k1]] += vis
        want = torch.ones(S, S, dtype=torch.int64)
        assert torch.equal(seen, want.tril() if causal else want), (S, world)


def test_merge_attention_equals_softmax_over_both_key_sets():
    g = torch.Generator().manual_seed(seed_of("merge"))
    s = torch.randn(1, 2, 5, 9, generator=g, dtype=torch.float64)
    val = torch.randn(1, 2, 9, 4, generator=g, dtype=torch.float64)
    vis = torch.ones(5, 9, dtype=torch.bool)
    vis[1, 4:] = False   # row 1: the second key set fully masked
    vis[2, :] = False    # row 2: nothing visible anywhere

    def part(keys):
        logits = s[..., keys].masked_fill(~vis[:, keys], -torch.inf)
        lse = torch.logsumexp(logits, -1)
        p = torch.exp(logits - torch.where(torch.isneginf(lse), 0, lse)[..., None])
        return (p @ val[:, :, keys]).float(), lse.float()

    out, lse = merge_attention(*part(slice(0, 4)), *part(slice(4, 9)))
    ref_out, ref_lse = part(slice(0, 9))
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.isneginf(lse[:, :, 2]).all() and (out[:, :, 2] == 0).all()
    assert_close(out, ref_out.double().numpy(), F32)
    assert_close(lse, ref_lse.double().numpy(), F32, kind="lse")


def test_merge_rows_keeps_the_unmerged_rows_and_promotes_to_float32():
    """A ring's state starts as the first block's result in the inputs' dtype; merging a later
    block into some of its rows gives float32 for every row, the other rows' values unchanged."""
    from fmha_iree.integrations.distributed import _merge_rows

    g = torch.Generator().manual_seed(seed_of("merge-rows"))
    s = torch.randn(1, 2, 6, 10, generator=g, dtype=torch.float64)
    val = torch.randn(1, 2, 10, 4, generator=g, dtype=torch.float64)

    def part(rows, keys):
        lse = torch.logsumexp(s[:, :, rows, keys], -1)
        return (torch.softmax(s[:, :, rows, keys], -1) @ val[:, :, keys]), lse

    o0, l0 = part(slice(0, 6), slice(0, 5))
    o1, l1 = part(slice(2, 6), slice(5, 10))
    out, lse = _merge_rows(o0.to(torch.bfloat16), l0.float(), o1.float(), l1.float(), 2, 6)
    assert out.dtype == F32 and lse.dtype == F32
    assert torch.equal(out[:, :, :2], o0[:, :, :2].to(torch.bfloat16).float())
    ref_out, ref_lse = part(slice(2, 6), slice(0, 10))
    assert_close(out[:, :, 2:], ref_out.numpy(), torch.bfloat16)
    assert_close(lse[:, :, 2:], ref_lse.numpy(), F32, kind="lse")
