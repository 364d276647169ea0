"""The public entry points: validate, plan, compile (cached) and run."""

from __future__ import annotations

import threading

from .toolchain import compile as _compile
from .runtime.device import DeviceTensor, get_device
from .codegen.entries import capabilities
from .problem.paged import check_paged
from .paths import (Capabilities, Loaded, Route, batch_route, group_route, paged_problem, prepare_batch,
                    problem_route, run_batch, run_group, run_paged)
from .runtime.prepared import PreparedCalls, varlen_call_key
from .runtime.module import FmhaModule
from .codegen.source import dense_params, is_fused
from .problem.spec import BatchProblem, KernelSpec, check_batch, check_tiles, check_varlen
from .problem.mask import as_mask
from .problem.targets import resolve_device
from .runtime.torch_gpu import TorchCall, torch_gpu
from .paths.sink_tokens import has_sink_tokens, with_batch_sink_tokens, with_varlen_sink_tokens
from .paths.sinks import varlen_rows, with_sinks as _with_sinks
from .problem.alibi import refuse_sink_tokens
from .problem.fp8 import dequantized_kv

__all__ = ["fmha_fwd", "fmha_fwd_varlen", "route", "cache_stats", "clear_memory_caches", "to_device"]

class LoadedModules:
    """Modules this process loaded, one per (spec, device URI), compiled or read from the cache
    on first use (``compile.get_vmfb``)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._modules: dict = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._modules)

    def get(self, spec: KernelSpec, device_uri: str) -> Loaded:
        key = (spec, device_uri)
        with self._lock:
            mod = self._modules.get(key)
        if mod is None:
            vmfb = _compile.get_vmfb(spec)
            module = FmhaModule(vmfb, device_uri, spec.module_name, typed_bf16=is_fused(spec))
            try:
                caps = Capabilities.from_record(capabilities(spec), module.functions)
            except ValueError as e:  # the cache checked the bytes and their spec: this would be a build fault
                raise RuntimeError(str(e)) from e
            with self._lock:
                mod = self._modules.setdefault(key, Loaded(module, caps))
        return mod

    def clear(self):
        with self._lock:
            self._modules.clear()


LOADED = LoadedModules()
PREPARED = PreparedCalls()


def cache_stats() -> dict:
    """Compile-cache counters of this process: ``compiles``, ``disk_hits``, ``memory_hits``, and
    ``modules`` (modules loaded on devices)."""
    return {**_compile.stats(), "modules": len(LOADED)}


def clear_memory_caches():
    """Forget this process's compiled and loaded modules (the disk cache stays): the next call of
    each spec reads the disk cache again."""
    _compile.clear_memory_cache()
    LOADED.clear()
    PREPARED.clear()


def _compiled(p: BatchProblem, tiles, device, specialize: bool = False):
    """(whether the module is the GPU formulation, ``() -> paths.Loaded``) for a problem on
    ``device``, compiling on first use.
    ``specialize``: a module with entry points fixed to this problem's length (and, on the CPU,
    batch and KV heads), when the problem is one they take (``_specialized``)."""
    device_uri, target = resolve_device(device)
    if p.q.on_device and p.q.array.device_uri != device_uri:
        raise ValueError(f"q lives on {p.q.array.device_uri!r} but device is {device_uri!r}")
    tiles = check_tiles(tiles, target, p.dq, p.dv, p.q.dtype)
    spec = p.kernel(tiles, target)
    if specialize:
        spec = _specialized(p, spec)
    get_device(device_uri)  # opened before anything compiles: an unavailable device is a ValueError now
    return is_fused(spec), lambda: LOADED.get(spec, device_uri)


def _specialized(p: BatchProblem, spec: KernelSpec) -> KernelSpec:
    """``spec`` with ``seqlens=(S,)`` (and on the CPU batch / kv_heads) when Sq == Sk == S, no
    cu_seqlen padding and S a multiple of the target's alignment; else ``spec`` unchanged."""
    import dataclasses

    from .codegen.rows import CPU_ROWS

    if p.sq != p.sk or p.sq == 0 or (p.q_lens != p.sq).any() or (p.k_lens != p.sk).any():
        return spec
    if spec.target.backend == "llvm-cpu":
        if p.sq % CPU_ROWS:
            return spec
        return dataclasses.replace(spec, seqlens=(p.sq,), batch=p.batch, kv_heads=p.hk)
    d = dense_params(spec)
    if not d or p.sq % d["align"]:
        return spec
    return dataclasses.replace(spec, seqlens=(p.sq,))


def to_device(x, device=None) -> DeviceTensor:
    """Copy a torch tensor or numpy array (float16, bfloat16, float32) to ``device`` once, so calls
    read it there: :func:`fmha_fwd` given DeviceTensors returns DeviceTensors and moves nothing
    over the host bus (``.to_numpy()`` / ``.to_torch()`` copy back)."""
    from .problem.operand import as_operand

    device_uri, _ = resolve_device(device)
    o = as_operand(x, "x")
    if o.on_device:
        return x if x.device_uri == device_uri else DeviceTensor.from_host(x.to_numpy(), x.dtype, device_uri)
    return DeviceTensor.from_host(o.array, o.dtype, device_uri)


def fmha_fwd(
    q, k, v, *, mask=None, scale=None, return_lse=False, layout="bhsd",
    cu_seqlen_q=None, cu_seqlen_k=None, tiles=None, device=None, specialize=False, softcap=None, sinks=None,
    alibi_slopes=None, bias=None, k_descale=None, v_descale=None,
):
    """CK's FMHA forward (batch mode): ``softmax(scale * q @ k^T, masked) @ v``.

    Args:
        q, k, v: torch tensors or numpy arrays of one dtype (float16, bfloat16, float32), or
            DeviceTensors (:func:`to_device`) on ``device``: then the results stay on the device
            as DeviceTensors too.
            ``layout="bhsd"``: q ``[B, Hq, Sq, Dq]``, k ``[B, Hk, Sk, Dq]``, v ``[B, Hk, Sk, Dv]``;
            ``layout="bshd"``: the same with the S and H axes swapped. ``Hq % Hk == 0`` (GQA/MQA:
            query head ``h`` reads K/V head ``h // (Hq // Hk)``).
        mask: None, a CK mask string (``0``, ``t``, ``b``, ``t:l,r``, ``b:l,r``, ``xt:w``, ``xb:w``)
            or a :class:`Mask`. Row ``i`` sees key ``j`` iff ``i - y + 1 <= j < min(i + x, Sk)``
            with CK's (y, x) (see ``fmha_iree.problem.mask``): causal ``t`` is ``j <= i``, causal ``b`` is
            ``j <= i + Sk - Sq``.
        scale: multiplies ``q @ k^T``; default ``1 / sqrt(Dq)``.
        return_lse: also return ``lse[b, h, i] = log(sum_j exp(scale * q_i . k_j))`` over the
            visible keys, float32 ``[B, Hq, Sq]``.
        cu_seqlen_q, cu_seqlen_k: int32 ``[B+1]`` cumulative lengths: batch ``b`` uses
            ``cu[b+1] - cu[b]`` rows / keys from the start of its slot; the rest is padding, never
            read, and its output rows are 0 (lse -inf).
        tiles: a :class:`TileConfig` overriding the target's default.
        device: an IREE device URI: ``"local-task"`` (default), ``"hip://0"``, ``"cuda://0"``.
        specialize: compile (once, then cached on disk) a module whose entry points are fixed to
            this call's sequence length (Sq == Sk, no padding; on the CPU also the batch size and
            KV heads): GPUs then get fused out-only kernels, the CPU row blocks
            of plain matmul/softmax (faster on the dev CPU, docs/BENCHMARKS.md). Other
            calls still run, on the generic entry points; the first call of each new shape pays a
            compile (tens of seconds).
        softcap: the logits soft-cap (Gemma 2, Grok; CK's ``logits_soft_cap``): each score
            ``s = scale * q . k`` becomes ``softcap * tanh(s / softcap)`` before the mask and the
            softmax (the LSE too). A constant of the compiled module: each value is a module of
            its own (compiled once, then cached).
        sinks: attention sinks (gpt-oss): float ``[Hq]``, head ``h``'s logit joins every row's
            softmax denominator (``paths.sinks``): out ``sum_j exp(s_j) v_j / (sum_j exp(s_j) +
            exp(sinks[h]))``, the LSE includes it, a row that sees no key gives 0 and lse
            ``sinks[h]``. Host arrays and torch tensors (not DeviceTensors).
        alibi_slopes: ALiBi (BLOOM, MPT; CK's convention): float ``[Hq]`` or ``[B, Hq]``; head
            ``h`` adds ``-slope * |p - j|`` to its score of key ``j``, ``p`` the row's position in
            the mask's frame (``i`` top-left, ``i + Sk - Sq`` bottom-right and without a mask),
            after the soft-cap, before the mask (``fmha_iree.problem.alibi``). Runs on a module
            of its own (``fwd_tiles`` with the slopes as an argument; compiled once, then
            cached); ``Hq == Hk``; masks whose rows see keys only at or left of their position
            (causal, windows without a right side) and decode.
        bias: an elementwise bias (CK's bias tensor: T5's relative positions, a padding bias): a
            float tensor or array broadcastable to ``[B, Hq, Sq, Sk]``, added to each score after
            the soft-cap, before the mask (the LSE includes it); read in the inputs' dtype, as
            CK's. Runs on a module of its own (``fwd_tiles`` with the bias as an argument;
            compiled once, then cached); any mask, GQA, decode; not with ``alibi_slopes`` (add
            ALiBi into the bias) nor sink tokens. Host arrays and torch tensors are laid out
            for the kernels first (``fmha_iree.problem.bias``); a DeviceTensor (beside
            DeviceTensor q, k, v) is read in place, so it must already be so laid out: the
            module's dtype, ``Hq == Hk``, no size-1 row or key dim, at least 128 rows (16 for
            decode-shaped calls).
        k_descale, v_descale: with ``k`` and ``v`` in fp8 (``float8_e4m3fn``, or gfx942's
            ``float8_e4m3fnuz``; torch tensors or ml_dtypes numpy arrays; an fp8 KV cache): the
            factors their values are multiplied by, a float or float ``[Hk]`` (one per KV head);
            default 1. K and V are dequantized to q's dtype before any path runs
            (``fmha_iree.problem.fp8``).

    Rows that see no key give 0 and lse ``-inf``. Returns ``out`` (the input's type, dtype and
    layout, ``Dv`` wide) or ``(out, lse)``.

    Which of the module's functions runs the call is the paths' choice (:func:`route` says which
    and why); all give the same results.
    """
    k, v, _ = dequantized_kv(q, k, v, k_descale, v_descale, layout=layout)
    if has_sink_tokens(mask):
        refuse_sink_tokens(alibi_slopes, bias)
        return with_batch_sink_tokens(
            lambda m: fmha_fwd(q, k, v, mask=m, scale=scale, return_lse=True, layout=layout, cu_seqlen_q=cu_seqlen_q,
                               cu_seqlen_k=cu_seqlen_k, tiles=tiles, device=device, specialize=specialize,
                               softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes, bias=bias),
            q, k, v, mask=mask, scale=scale, layout=layout, cu_seqlen_q=cu_seqlen_q, cu_seqlen_k=cu_seqlen_k,
            softcap=softcap, return_lse=return_lse)
    if sinks is not None:
        return _with_sinks(lambda: fmha_fwd(q, k, v, mask=mask, scale=scale, return_lse=True, layout=layout,
                                            cu_seqlen_q=cu_seqlen_q, cu_seqlen_k=cu_seqlen_k, tiles=tiles, device=device,
                                            specialize=specialize, softcap=softcap, alibi_slopes=alibi_slopes, bias=bias),
                           q, sinks, 2 if layout == "bshd" else 1, layout, return_lse)
    gpu = torch_gpu({"q": q, "k": k, "v": v}, device)
    if gpu is not None:  # torch GPU tensors: shared with IREE both ways (torch_gpu)
        call = TorchCall(gpu)
        out = fmha_fwd(*call.inputs((q, k, v)), mask=mask, scale=scale, return_lse=return_lse, layout=layout,
                       cu_seqlen_q=cu_seqlen_q, cu_seqlen_k=cu_seqlen_k, tiles=tiles, device=gpu.uri,
                       specialize=specialize, softcap=softcap, alibi_slopes=alibi_slopes, bias=bias)
        return call.outputs(out)
    key = None if bias is not None else varlen_call_key(q, k, v, (cu_seqlen_q, cu_seqlen_k, alibi_slopes), mask, scale, return_lse, layout, tiles,
                          device, specialize, softcap)
    run = PREPARED.get(key)
    if run is not None:
        return run(q, k, v)
    p = check_batch(q, k, v, mask=mask, scale=scale, layout=layout, cu_seqlen_q=cu_seqlen_q, cu_seqlen_k=cu_seqlen_k,
                    softcap=softcap, alibi_slopes=alibi_slopes, bias=bias)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if not isinstance(specialize, bool):
        raise TypeError(f"specialize must be a bool, got {type(specialize).__name__}")
    _, get = _compiled(p, tiles, device, specialize)
    if key is not None:
        run = prepare_batch(p, return_lse, get)
        PREPARED.put(key, run)
        if run is not None:
            return run(q, k, v)
    return run_batch(p, return_lse, get)


def route(q, k, v, *, mask=None, return_lse=False, layout="bhsd", cu_seqlen_q=None, cu_seqlen_k=None, seqstart_q=None,
          seqstart_k=None, seqlen_k=None, seqstart_padded_q=None, seqstart_padded_k=None, block_table=None,
          tiles=None, device=None, specialize=False, softcap=None, alibi_slopes=None, bias=None, k_descale=None,
          v_descale=None) -> Route:
    """The path a call with these arguments takes, without running it: :func:`fmha_fwd`'s (batch
    mode) or, given ``seqstart_q``, :func:`fmha_fwd_varlen`'s (group mode; a paged cache with
    ``block_table``). The :class:`paths.Route` names the path, the module function it calls and
    why; ``str()`` of it also lists each path tried before with the reasons it refused. Loads (and
    on first use compiles) the module, as the call would."""
    if not isinstance(return_lse, bool) or not isinstance(specialize, bool):
        raise TypeError("return_lse and specialize must be bools")
    k, v, block_table = dequantized_kv(q, k, v, k_descale, v_descale, layout=layout, group=seqstart_q is not None,
                                             block_table=block_table, seqlen_k=seqlen_k)
    mask = as_mask(mask).window_only  # sink tokens are added to the path's results (paths.sink_tokens)
    if seqstart_q is None:
        for name, val in (("seqstart_k", seqstart_k), ("seqlen_k", seqlen_k), ("seqstart_padded_q", seqstart_padded_q),
                          ("seqstart_padded_k", seqstart_padded_k), ("block_table", block_table)):
            if val is not None:
                raise ValueError(f"{name} is group mode's: give seqstart_q too")
        p = check_batch(q, k, v, mask=mask, scale=None, layout=layout, cu_seqlen_q=cu_seqlen_q, cu_seqlen_k=cu_seqlen_k,
                        softcap=softcap, alibi_slopes=alibi_slopes, bias=bias)
        return batch_route(p, return_lse, _compiled(p, tiles, device, specialize)[1])
    if block_table is not None:
        cache = check_paged(k, v, seqstart_q, seqstart_k, seqlen_k, seqstart_padded_k, block_table)
        prob = paged_problem(q, cache, seqstart_q, seqstart_padded_q, mask=mask, scale=None, with_lse=return_lse,
                             softcap=softcap, alibi_slopes=alibi_slopes, bias=bias)
        return problem_route(prob, _compiled(prob.p, tiles, device)[1])
    p, starts = check_varlen(q, k, v, seqstart_q, seqstart_k, seqlen_k=seqlen_k, seqstart_padded_q=seqstart_padded_q,
                             seqstart_padded_k=seqstart_padded_k, mask=mask, scale=None, softcap=softcap,
                             alibi_slopes=alibi_slopes, bias=bias)
    return group_route(p, starts, return_lse, _compiled(p, tiles, device)[1])


def fmha_fwd_varlen(
    q, k, v, seqstart_q, seqstart_k, *, seqlen_k=None, seqstart_padded_q=None, seqstart_padded_k=None,
    block_table=None, mask=None, scale=None, return_lse=False, tiles=None, device=None, softcap=None, sinks=None,
    alibi_slopes=None, bias=None, k_descale=None, v_descale=None,
):
    """CK's FMHA forward in group mode: sequences packed along the token axis ("thd").

    Args:
        q, k, v: ``[Tq, Hq, Dq]``, ``[Tk, Hk, Dq]``, ``[Tk, Hk, Dv]``.
        seqstart_q, seqstart_k: int32 ``[B+1]``, starting at 0, non-decreasing: sequence ``b`` has
            ``seqstart_q[b+1] - seqstart_q[b]`` queries and ``seqstart_k[b+1] - seqstart_k[b]`` keys.
        seqlen_k: int32 ``[B]``: keys actually used per sequence (a KV cache holding more).
        seqstart_padded_q, seqstart_padded_k: int32 ``[B+1]`` physical starts when sequences are
            stored with gaps: offsets come from these, lengths from the unpadded starts.
        block_table: int32 ``[B, max_pages]``, a paged KV cache (``fmha_iree.problem.paged``): ``k`` / ``v``
            are then ``[num_pages, page_size, Hk, D]``, ``seqstart_k`` is None and ``seqlen_k``
            gives each sequence's key count; sequence ``b``'s key ``j`` lives in page
            ``block_table[b, j // page_size]``, row ``j % page_size`` (read on the device by GPU
            modules, host arrays or DeviceTensors; CPU modules gather the used keys on the host,
            host arrays only).
        mask: as in :func:`fmha_fwd`, applied per sequence with that sequence's own lengths
            (bottom-right aligns each sequence's last query with its last key).
        softcap, sinks: as in :func:`fmha_fwd`; ``alibi_slopes`` too, ``[B, Hq]`` one row per sequence.
        bias: as in :func:`fmha_fwd`, laid out as a padded batch: broadcastable to ``[B, Hq, Sq',
            Sk']`` with ``Sq'`` / ``Sk'`` at least the longest sequence's query rows / keys;
            sequence ``b`` reads ``bias[b, h, i, j]`` at its own row ``i`` and key ``j``.
        k_descale, v_descale: as in :func:`fmha_fwd` (fp8 K / V; a paged fp8 cache is
            dequantized only in the pages the call's keys use).

    Returns ``out [Tq, Hq, Dv]`` (rows owned by no sequence are 0) or ``(out, lse)`` with lse
    float32 ``[Hq, seqstart_q[-1]]`` indexed by the unpadded starts. One compiled module serves any
    number of sequences and any lengths.
    """
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    k, v, block_table = dequantized_kv(q, k, v, k_descale, v_descale, group=True,
                                             block_table=block_table, seqlen_k=seqlen_k)
    if has_sink_tokens(mask):
        refuse_sink_tokens(alibi_slopes, bias)
        ints = dict(seqlen_k=seqlen_k, seqstart_padded_q=seqstart_padded_q, seqstart_padded_k=seqstart_padded_k,
                    block_table=block_table)
        return with_varlen_sink_tokens(
            lambda m: fmha_fwd_varlen(q, k, v, seqstart_q, seqstart_k, **ints, mask=m, scale=scale, return_lse=True,
                                      tiles=tiles, device=device, softcap=softcap, sinks=sinks,
                                      alibi_slopes=alibi_slopes, bias=bias),
            q, k, v, seqstart_q, seqstart_k, **ints, mask=mask, scale=scale, softcap=softcap, return_lse=return_lse)
    if sinks is not None:
        rows = varlen_rows(seqstart_q, seqstart_padded_q)
        return _with_sinks(lambda: fmha_fwd_varlen(
            q, k, v, seqstart_q, seqstart_k, seqlen_k=seqlen_k, seqstart_padded_q=seqstart_padded_q,
            seqstart_padded_k=seqstart_padded_k, block_table=block_table, mask=mask, scale=scale, return_lse=True,
            tiles=tiles, device=device, softcap=softcap, alibi_slopes=alibi_slopes, bias=bias), q, sinks, 1, "thd", return_lse, rows)
    gpu = torch_gpu({"q": q, "k": k, "v": v}, device)
    if gpu is not None:  # torch GPU tensors: shared with IREE both ways (torch_gpu)
        call = TorchCall(gpu)
        out = fmha_fwd_varlen(*call.inputs((q, k, v)), seqstart_q, seqstart_k, seqlen_k=seqlen_k,
                              seqstart_padded_q=seqstart_padded_q, seqstart_padded_k=seqstart_padded_k,
                              block_table=block_table, mask=mask, scale=scale, return_lse=return_lse, tiles=tiles,
                              device=gpu.uri, softcap=softcap, alibi_slopes=alibi_slopes, bias=bias)
        return call.outputs(out)
    key = None if bias is not None else varlen_call_key(
        q, k, v, (seqstart_q, seqstart_k, seqlen_k, seqstart_padded_q, seqstart_padded_k, block_table,
                                    alibi_slopes), "varlen", mask, scale, return_lse, tiles, device, softcap)
    run = PREPARED.get(key)
    if run is not None:
        return run(q, k, v)
    memo = PREPARED.memo(key)
    if block_table is not None:
        cache = check_paged(k, v, seqstart_q, seqstart_k, seqlen_k, seqstart_padded_k, block_table)
        prob = paged_problem(q, cache, seqstart_q, seqstart_padded_q, mask=mask, scale=scale, with_lse=return_lse,
                             softcap=softcap, alibi_slopes=alibi_slopes, bias=bias)
        fused, get = _compiled(prob.p, tiles, device)
        if cache.on_device and not fused:  # the CPU formulation reads a paged cache on the host: refused before compiling
            raise TypeError("k_cache: CPU modules read a paged cache from host arrays (torch CPU tensors or numpy); "
                            "got a DeviceTensor")
        return run_paged(prob, get, memo)
    p, starts = check_varlen(q, k, v, seqstart_q, seqstart_k, seqlen_k=seqlen_k, seqstart_padded_q=seqstart_padded_q,
                             seqstart_padded_k=seqstart_padded_k, mask=mask, scale=scale, softcap=softcap,
                             alibi_slopes=alibi_slopes, bias=bias)
    return run_group(p, starts, return_lse, _compiled(p, tiles, device)[1], memo)

