"""Deployed modules: a ``.vmfb`` compiled ahead of time (``fmha-iree compile``) and its manifest,
loaded and called like :func:`fmha_iree.fmha_fwd` / :func:`fmha_iree.fmha_fwd_varlen`.

Needs only ``iree-base-runtime`` and numpy (no torch, no compiler). Every call is checked against
the manifest (dtype, heads, head dims, layout) before anything runs.
"""

from __future__ import annotations

import json
from pathlib import Path

from .problem.abi import MANIFEST_FORMAT
from .problem.paged import check_paged
from .paths import (Capabilities, Loaded, Route, batch_route, group_route, paged_problem, prepare_batch,
                    problem_route, run_batch, run_group, run_paged)
from .runtime.prepared import PreparedCalls, varlen_call_key
from .runtime.module import FmhaModule
from .paths.sink_tokens import has_sink_tokens, with_batch_sink_tokens, with_varlen_sink_tokens
from .paths.sinks import varlen_rows, with_sinks
from .problem.fp8 import dequantized_kv
from .problem.alibi import refuse_sink_tokens
from .problem.spec import check_batch, check_softcap, check_varlen
from .problem.targets import resolve_device
from .runtime.torch_gpu import TorchCall, torch_gpu

__all__ = ["DeployedFmha", "load"]


class DeployedFmha:
    """A module compiled ahead of time (``fmha-iree compile``), loaded with its manifest.

    Call it like :func:`fmha_iree.fmha_fwd` without ``layout``/``tiles``/``device`` (fixed by the
    module); inputs are checked against the manifest before anything runs.
    """

    def __init__(self, manifest: dict, loaded: Loaded):
        self.manifest = manifest
        self._loaded = loaded
        self.tiles = loaded.caps.tiles
        self._prepared = PreparedCalls()

    @property
    def capabilities(self) -> Capabilities:
        """What the module can run (``paths.capabilities``), read from its manifest."""
        return self._loaded.caps

    @property
    def device_uri(self) -> str:
        """The IREE device the module was loaded on (``local-task``, ``cuda://0`` ...)."""
        return self._loaded.module.device_uri

    def _get(self) -> Loaded:
        return self._loaded

    @property
    def softcap(self) -> float | None:
        """The logits soft-cap compiled into the module (``fmha-iree compile --softcap``), or None."""
        return (self.manifest.get("variants") or {}).get("softcap")

    def _softcap(self, softcap):
        """Refuse a call's ``softcap`` other than the module's."""
        if softcap is not None and check_softcap(softcap) != (self.softcap or 0.0):
            raise ValueError(f"softcap={softcap}: the module was compiled with softcap={self.softcap} "
                             "(a constant of its kernels: fmha-iree compile --softcap)")

    def __call__(self, q, k, v, *, mask=None, scale=None, return_lse=False, cu_seqlen_q=None, cu_seqlen_k=None,
                 softcap=None, sinks=None, alibi_slopes=None, bias=None, k_descale=None, v_descale=None):
        """Batch mode, as :func:`fmha_iree.fmha_fwd`. A repeated call on DeviceTensors of the
        same shapes (and cu_seqlen values) replays its checked and routed form
        (``prepared.PreparedCalls``). torch GPU tensors on the module's GPU are shared with it
        both ways (``torch_gpu``). ``softcap``: the module's own, or None; ``sinks``: as
        :func:`fmha_iree.fmha_fwd`'s; ``alibi_slopes`` too, on a module compiled with ``--alibi``
        (which needs them), and ``bias`` on one compiled with ``--bias``; fp8 ``k`` / ``v`` with
        ``k_descale`` / ``v_descale`` on any module of q's dtype."""
        self._softcap(softcap)
        pr = self.manifest["problem"]
        layout, given = pr["layout"], pr.get("mask") if mask is None else mask  # the module's default mask
        k, v, _ = dequantized_kv(q, k, v, k_descale, v_descale, layout=layout)
        if has_sink_tokens(given):
            refuse_sink_tokens(alibi_slopes, bias)
            return with_batch_sink_tokens(
                lambda m: self(q, k, v, mask=m, scale=scale, return_lse=True, cu_seqlen_q=cu_seqlen_q,
                               cu_seqlen_k=cu_seqlen_k, sinks=sinks, alibi_slopes=alibi_slopes, bias=bias),
                q, k, v, mask=given, scale=scale, layout=layout, cu_seqlen_q=cu_seqlen_q, cu_seqlen_k=cu_seqlen_k,
                softcap=self.softcap, return_lse=return_lse)
        if sinks is not None:
            return with_sinks(lambda: self(q, k, v, mask=mask, scale=scale, return_lse=True, cu_seqlen_q=cu_seqlen_q,
                                           cu_seqlen_k=cu_seqlen_k, alibi_slopes=alibi_slopes, bias=bias), q, sinks,
                              2 if layout == "bshd" else 1, layout, return_lse)
        gpu = torch_gpu({"q": q, "k": k, "v": v}, self.device_uri)
        if gpu is not None:
            call = TorchCall(gpu)
            return call.outputs(self._batch_call(*call.inputs((q, k, v)), mask, scale, return_lse, cu_seqlen_q,
                                                 cu_seqlen_k, (alibi_slopes, bias)))
        return self._batch_call(q, k, v, mask, scale, return_lse, cu_seqlen_q, cu_seqlen_k, (alibi_slopes, bias))

    def _batch_call(self, q, k, v, mask, scale, return_lse, cu_seqlen_q, cu_seqlen_k, biases=(None, None)):
        alibi, bias = biases
        key = None if bias is not None else varlen_call_key(q, k, v, (cu_seqlen_q, cu_seqlen_k, alibi), mask, scale,
                                                            return_lse)
        run = self._prepared.get(key)
        if run is not None:
            return run(q, k, v)
        p = self._batch(q, k, v, mask, scale, cu_seqlen_q, cu_seqlen_k, return_lse, biases)
        if key is not None:
            run = prepare_batch(p, return_lse, self._get)
            self._prepared.put(key, run)
            if run is not None:
                return run(q, k, v)
        return run_batch(p, return_lse, self._get)

    def route(self, q, k, v, *, mask=None, scale=None, return_lse=False, cu_seqlen_q=None, cu_seqlen_k=None,
              seqstart_q=None, seqstart_k=None, seqlen_k=None, seqstart_padded_q=None, seqstart_padded_k=None,
              block_table=None, alibi_slopes=None, bias=None, k_descale=None, v_descale=None) -> Route:
        """The path a call with these arguments would take, without running it: a batch-mode
        call's or, given ``seqstart_q``, :meth:`varlen`'s (a paged cache with ``block_table``).
        ``str()`` of the :class:`paths.Route` lists each path tried before with its reasons."""
        k, v, block_table = dequantized_kv(q, k, v, k_descale, v_descale, layout=self.manifest["problem"]["layout"],
                                           group=seqstart_q is not None, block_table=block_table, seqlen_k=seqlen_k)
        if seqstart_q is None:
            p = self._batch(q, k, v, mask, scale, cu_seqlen_q, cu_seqlen_k, return_lse, (alibi_slopes, bias))
            return batch_route(p, return_lse, self._get)
        mask = self._group_mask(mask)
        if block_table is not None:
            cache = check_paged(k, v, seqstart_q, seqstart_k, seqlen_k, seqstart_padded_k, block_table)
            prob = paged_problem(q, cache, seqstart_q, seqstart_padded_q, mask=mask, scale=scale, with_lse=return_lse,
                                 alibi_slopes=alibi_slopes, bias=bias)
            self._check(prob.p, return_lse)
            return problem_route(prob, self._get)
        p, starts = check_varlen(q, k, v, seqstart_q, seqstart_k, seqlen_k=seqlen_k, seqstart_padded_q=seqstart_padded_q,
                                 seqstart_padded_k=seqstart_padded_k, mask=mask, scale=scale, alibi_slopes=alibi_slopes, bias=bias)
        self._check(p, return_lse)
        return group_route(p, starts, return_lse, self._get)

    def _group_mask(self, mask):
        """The call's mask (the module's default where None), once the module is known to take
        group mode."""
        pr = self.manifest["problem"]
        if pr["layout"] != "bshd":
            raise ValueError(f"group mode needs a module compiled with --layout bshd; this one has layout {pr['layout']!r}")
        return pr.get("mask") if mask is None else mask

    def varlen(self, q, k, v, seqstart_q, seqstart_k, *, seqlen_k=None, seqstart_padded_q=None,
               seqstart_padded_k=None, block_table=None, mask=None, scale=None, return_lse=False, softcap=None,
               sinks=None, alibi_slopes=None, bias=None, k_descale=None, v_descale=None):
        """Group mode, as :func:`fmha_iree.fmha_fwd_varlen` (``q`` ``[Tq, Hq, Dq]`` ...; a paged
        cache with ``block_table``): needs a module compiled with ``--layout bshd`` (packed tokens
        are bshd rows of one sequence). A call on DeviceTensors whose shapes and metadata values
        (starts, lengths, block table) repeat an earlier one's replays its plan
        (``prepared.varlen_call_key``). ``softcap``, ``sinks``, ``alibi_slopes``, ``bias``: as :meth:`__call__`'s
        (``bias`` as :func:`fmha_iree.fmha_fwd_varlen`'s); ``k_descale``, ``v_descale`` too (fp8 K / V)."""
        mask = self._group_mask(mask)
        self._softcap(softcap)
        k, v, block_table = dequantized_kv(q, k, v, k_descale, v_descale, group=True,
                                                 block_table=block_table, seqlen_k=seqlen_k)
        if has_sink_tokens(mask):
            refuse_sink_tokens(alibi_slopes, bias)
            ints = dict(seqlen_k=seqlen_k, seqstart_padded_q=seqstart_padded_q, seqstart_padded_k=seqstart_padded_k,
                        block_table=block_table)
            return with_varlen_sink_tokens(
                lambda m: self.varlen(q, k, v, seqstart_q, seqstart_k, **ints, mask=m, scale=scale, return_lse=True,
                                      sinks=sinks, alibi_slopes=alibi_slopes, bias=bias),
                q, k, v, seqstart_q, seqstart_k, **ints, mask=mask, scale=scale, softcap=self.softcap,
                return_lse=return_lse)
        if sinks is not None:
            return with_sinks(lambda: self.varlen(
                q, k, v, seqstart_q, seqstart_k, seqlen_k=seqlen_k, seqstart_padded_q=seqstart_padded_q,
                seqstart_padded_k=seqstart_padded_k, block_table=block_table, mask=mask, scale=scale,
                return_lse=True, alibi_slopes=alibi_slopes, bias=bias), q, sinks, 1, "thd", return_lse,
                varlen_rows(seqstart_q, seqstart_padded_q))
        gpu = torch_gpu({"q": q, "k": k, "v": v}, self.device_uri)
        if gpu is not None:
            call = TorchCall(gpu)
            return call.outputs(self.varlen(*call.inputs((q, k, v)), seqstart_q, seqstart_k, seqlen_k=seqlen_k,
                                            seqstart_padded_q=seqstart_padded_q, seqstart_padded_k=seqstart_padded_k,
                                            block_table=block_table, mask=mask, scale=scale,
                                            return_lse=return_lse, alibi_slopes=alibi_slopes, bias=bias))

        key = None if bias is not None else varlen_call_key(
            q, k, v, (seqstart_q, seqstart_k, seqlen_k, seqstart_padded_q, seqstart_padded_k, block_table, alibi_slopes),
            "varlen", mask, scale, return_lse)
        run = self._prepared.get(key)
        if run is not None:
            return run(q, k, v)

        memo = self._prepared.memo(key)
        if block_table is not None:
            cache = check_paged(k, v, seqstart_q, seqstart_k, seqlen_k, seqstart_padded_k, block_table)
            prob = paged_problem(q, cache, seqstart_q, seqstart_padded_q, mask=mask, scale=scale, with_lse=return_lse,
                                 alibi_slopes=alibi_slopes, bias=bias)
            self._check(prob.p, return_lse)
            if cache.on_device and self.capabilities.formulation == "cpu":
                raise TypeError("k_cache: CPU modules read a paged cache from host arrays (torch CPU tensors or numpy); "
                                "got a DeviceTensor")
            return run_paged(prob, self._get, memo)
        p, starts = check_varlen(q, k, v, seqstart_q, seqstart_k, seqlen_k=seqlen_k, seqstart_padded_q=seqstart_padded_q,
                                 seqstart_padded_k=seqstart_padded_k, mask=mask, scale=scale, alibi_slopes=alibi_slopes, bias=bias)
        self._check(p, return_lse)
        return run_group(p, starts, return_lse, self._get, memo)

    def _batch(self, q, k, v, mask, scale, cu_seqlen_q, cu_seqlen_k, return_lse, biases=(None, None)):
        """A batch-mode call checked against the arguments' rules and the manifest; ``biases``:
        (ALiBi slopes, elementwise bias)."""
        pr = self.manifest["problem"]
        p = check_batch(q, k, v, mask=pr.get("mask") if mask is None else mask, scale=scale, layout=pr["layout"],
                        cu_seqlen_q=cu_seqlen_q, cu_seqlen_k=cu_seqlen_k, alibi_slopes=biases[0], bias=biases[1])
        self._check(p, return_lse)
        return p

    def _check(self, p, return_lse):
        """Refuse a problem the module was not compiled for, before anything runs."""
        self.check_heads(p.q.dtype, p.hq, p.hk, p.dq, p.dv)
        if not isinstance(return_lse, bool):
            raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")

    def check_heads(self, dtype: str, hq: int, hk: int, dq: int, dv: int):
        """Refuse, naming the argument, a dtype (``f16`` / ``bf16`` / ``f32``), head counts or head
        dims the module was not compiled for."""
        pr = self.manifest["problem"]
        if dtype != pr["dtype"]:
            raise TypeError(f"q has dtype {dtype} but the module was compiled for {pr['dtype']}")
        if hq // hk != pr["group"]:
            raise ValueError(f"q/k heads {hq}/{hk} give a group of {hq // hk}; the module expects {pr['group']}")
        if (dq, dv) != (pr["hdim"], pr["hdim_v"]):
            raise ValueError(f"head dims q/k {dq}, v {dv} differ from the module's {pr['hdim']}, {pr['hdim_v']}")
        for key, have in (("heads", hq), ("kv_heads", hk)):
            if pr.get(key) not in (None, have):
                raise ValueError(f"{'q' if key == 'heads' else 'k'} has {have} heads; the module was compiled for {pr[key]}")


def load(path, device: str = "local-task") -> DeployedFmha:
    """Load ``path`` (a ``.vmfb`` written by ``fmha-iree compile``) and its ``.json`` manifest on
    ``device``. Needs only ``iree-base-runtime`` and numpy.

    The bytes are checked against the manifest's sha256 before they reach IREE's runtime (a
    damaged module can crash it), and the module's functions against the manifest's capabilities;
    either mismatch, or a manifest of another format (a module compiled by an earlier fmha_iree), is
    a ``ValueError`` naming the file."""
    import hashlib

    path = Path(path)
    manifest = json.loads(path.with_suffix(".json").read_text())
    if not isinstance(manifest, dict) or not str(manifest.get("format", "")).startswith("fmha_iree.module/"):
        raise ValueError(f"{path.with_suffix('.json')} is not an fmha_iree module manifest")
    if manifest["format"] != MANIFEST_FORMAT:
        raise ValueError(f"{path} was compiled by an earlier fmha_iree (manifest {manifest['format']}, this one reads "
                         f"{MANIFEST_FORMAT}): compile it again with fmha-iree compile")
    vmfb = path.read_bytes()
    want = manifest.get("sha256")
    if want is not None and hashlib.sha256(vmfb).hexdigest() != want:
        raise ValueError(f"{path} does not match its manifest's sha256 (damaged, or another module's file)")
    uri, _ = resolve_device(device)
    mod = FmhaModule(vmfb, uri, manifest["module"], typed_bf16=manifest["capabilities"]["formulation"] == "gpu")
    try:
        caps = Capabilities.from_record(manifest["capabilities"], mod.functions)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    return DeployedFmha(manifest, Loaded(mod, caps))
