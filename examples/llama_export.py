#!/usr/bin/env python3
"""A small Llama-style decoder (random weights, RoPE, GQA, a paged KV cache) exported as ONE IREE
module with ``prefill`` and ``decode`` entry points and fmha_iree's attention inside, then run for
greedy generation through ``iree.runtime`` alone and checked against the same model in torch eager
with torch's SDPA.

    python examples/llama_export.py [--target host] [--tokens 16] [--out llama.vmfb]

The cache is ``[layers, 2, pages * page, Hk, D]`` (K and V of every layer, pages of ``page`` rows);
``block_table`` int64 ``[max_pages]`` maps a sequence's page ``i`` to its page in the cache. Each
entry point writes the new tokens' K / V into their pages, gathers the context's keys from the
pages (``context`` int64 ``[T]``: the positions 0 .. T-1, its length the context's) and attends with
CK's bottom-right causal mask ``b`` (the new rows are the last of the context); it returns the
last token's logits and the updated cache. ``--target gfx942`` / ``sm_80`` export and compile for a
GPU (run it there with ``--device``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import numpy as np
import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 512
    dim: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    hidden: int = 512
    page: int = 16
    pages: int = 16
    theta: float = 10000.0
    dtype: torch.dtype = torch.float32


def _rope(x, pos, theta):
    """Rotary embedding of x ``[1, S, H, D]`` at positions ``pos`` ``[S]`` (rotate-half form)."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    ang = pos.to(torch.float32)[:, None] * inv[None, :]
    cos, sin = (f(ang).repeat(1, 2)[None, :, None, :].to(x.dtype) for f in (torch.cos, torch.sin))
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return x * cos + half * sin


class Decoder(nn.Module):
    """The model; ``attention="fmha_iree"`` calls fmha_iree (eager: its modules; exported: its
    kernel inside the model), ``"sdpa"`` torch's SDPA with an explicit bottom-right causal mask
    (exported: IREE's own attention), or a callable ``(q, k, v) -> out`` (bshd, mask ``b``)."""

    def __init__(self, cfg: Config, attention="fmha_iree", seed: int = 0):
        super().__init__()
        self.cfg, self.attention = cfg, attention
        g = torch.Generator().manual_seed(seed)
        w = lambda *s: nn.Parameter((torch.randn(*s, generator=g) / math.sqrt(s[-1])).to(cfg.dtype))  # noqa: E731
        c = cfg
        self.embed = w(c.vocab, c.dim)
        self.wq, self.wk, self.wv = w(c.layers, c.heads * c.head_dim, c.dim), w(c.layers, c.kv_heads * c.head_dim, c.dim), \
            w(c.layers, c.kv_heads * c.head_dim, c.dim)
        self.wo = w(c.layers, c.dim, c.heads * c.head_dim)
        self.w1, self.w3, self.w2 = w(c.layers, c.hidden, c.dim), w(c.layers, c.hidden, c.dim), w(c.layers, c.dim, c.hidden)
        self.head = w(c.vocab, c.dim)

    def _attend(self, q, k, v):
        if callable(self.attention):
            return self.attention(q, k, v)
        if self.attention == "fmha_iree":
            from fmha_iree.integrations.torch_ops import attention

            return attention(q, k, v, mask="b", layout="bshd")
        sq, sk = q.shape[1], k.shape[1]
        vis = torch.arange(sk, device=q.device)[None, :] <= torch.arange(sq, device=q.device)[:, None] + (sk - sq)
        # an additive [1, 1, Sq, Sk] mask: IREE 3.13 failed to compile turbine's SDPA lowering
        # with a two-dimensional one (boolean or additive)
        bias = torch.zeros(vis.shape, dtype=q.dtype, device=q.device).masked_fill(~vis, float("-inf"))
        out = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         attn_mask=bias[None, None], enable_gqa=True)
        return out.transpose(1, 2)

    def step(self, tokens, context, cache, block_table):
        """``tokens`` int64 ``[1, S]`` at the last S positions of ``context``: (last logits
        ``[1, vocab]``, the cache with their K / V written)."""
        c = self.cfg
        s = tokens.shape[1]
        pos = context[context.shape[0] - s:]
        slot = lambda p: block_table[p // c.page] * c.page + p % c.page  # noqa: E731
        new_slots, ctx_slots = slot(pos), slot(context)
        norm = lambda x: x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5)  # noqa: E731
        x = self.embed[tokens]
        rows = c.pages * c.page
        flat = cache.reshape(-1, c.kv_heads, c.head_dim)  # layer i's K at rows 2i * rows, its V after them
        for i in range(c.layers):
            h = norm(x)
            q = _rope((h @ self.wq[i].T).view(1, s, c.heads, c.head_dim), pos, c.theta)
            k = _rope((h @ self.wk[i].T).view(1, s, c.kv_heads, c.head_dim), pos, c.theta)
            v = (h @ self.wv[i].T).view(1, s, c.kv_heads, c.head_dim)
            kb, vb = 2 * i * rows, (2 * i + 1) * rows
            flat = flat.index_copy(0, new_slots + kb, k[0]).index_copy(0, new_slots + vb, v[0])
            o = self._attend(q, flat.index_select(0, ctx_slots + kb)[None], flat.index_select(0, ctx_slots + vb)[None])
            x = x + o.reshape(1, s, c.heads * c.head_dim) @ self.wo[i].T
            h = norm(x)
            x = x + (nn.functional.silu(h @ self.w1[i].T) * (h @ self.w3[i].T)) @ self.w2[i].T
        return (norm(x[:, -1]) @ self.head.T).float(), flat.reshape(cache.shape)

    def new_cache(self):
        c = self.cfg
        return torch.zeros(c.layers, 2, c.pages * c.page, c.kv_heads, c.head_dim, dtype=c.dtype)


def export(model: Decoder, target: str, prompt_len: int = 8, external_params: bool = False,
           prefill_len: int | None = None):
    """``prefill`` and ``decode`` in one exported module (MLIR with fmha_iree's kernel inside).
    ``external_params``: the weights are not in the module but named parameters of scope
    ``model``, given at load time (``parameters``), as large models are deployed.
    ``prefill_len``: prefill takes exactly that many tokens (a serving bucket) instead of any
    number: with a dynamic token count IREE 3.13 configures the CUDA matmuls as matrix-vector
    products (one output per workgroup; docs/model-export.md)."""
    from iree.turbine import aot

    from fmha_iree.integrations.model_export import export_model

    if external_params:
        aot.externalize_module_parameters(model, external_scope="model")
    cache, table = model.new_cache(), torch.arange(model.cfg.pages)
    fxb = aot.FxProgramsBuilder(model)
    s, t = torch.export.Dim("s", max=model.cfg.pages * model.cfg.page), torch.export.Dim("t", max=model.cfg.pages * model.cfg.page)

    n = prefill_len or prompt_len
    dyn = {} if prefill_len else {"tokens": {1: s}, "context": {0: s}}

    @fxb.export_program(name="prefill", args=(torch.zeros(1, n, dtype=torch.int64), torch.arange(n), cache, table),
                        dynamic_shapes={"tokens": {}, "context": {}, "cache": {}, "block_table": {}, **dyn})
    def prefill(m, tokens, context, cache, block_table):
        return m.step(tokens, context, cache, block_table)

    @fxb.export_program(name="decode", args=(torch.zeros(1, 1, dtype=torch.int64), torch.arange(prompt_len + 1), cache,
                                             table),
                        dynamic_shapes={"tokens": {}, "context": {0: t}, "cache": {}, "block_table": {}})
    def decode(m, tokens, context, cache, block_table):
        return m.step(tokens, context, cache, block_table)

    return export_model(fxb, target=target)


def load(vmfb: bytes, device="local-task", params: dict | None = None):
    """The module's functions on ``device`` (a URI: the process's IREE device of that URI; or an
    ``iree.runtime.HalDevice``) through ``iree.runtime`` only; ``params`` (name -> numpy array) for
    a module exported with ``external_params``."""
    import iree.runtime as rt

    dev = rt.get_device(device) if isinstance(device, str) else device
    ctx = rt.SystemContext(config=rt.Config(device=dev))
    if params is not None:
        index = rt.ParameterIndex()
        for name, array in params.items():
            index.add_buffer(name, np.ascontiguousarray(array))
        ctx.add_vm_module(rt.create_io_parameters_module(ctx.instance, index.create_provider(scope="model")))
    ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, vmfb))
    return ctx.modules.module


def weights(model: Decoder) -> dict:
    """The model's weights by parameter name, as numpy arrays (``load``'s ``params``)."""
    return {name: p.detach().cpu().numpy() for name, p in model.named_parameters()}


def generate_iree(vmfb: bytes, prompt: list[int], n: int, table: np.ndarray, cache: np.ndarray, device="local-task",
                  params: dict | None = None):
    """Greedy generation through ``iree.runtime`` only: the tokens and each step's logits."""
    mod = load(vmfb, device, params)
    tokens, logits = list(prompt), []
    out, cache = mod["prefill"](np.array([prompt], np.int64), np.arange(len(prompt), dtype=np.int64), cache, table)
    for _ in range(n):
        logits.append(np.array(out.to_host())[0])  # a copy: the result buffer is reused by later calls
        tokens.append(int(logits[-1].argmax()))
        out, cache = mod["decode"](np.array([[tokens[-1]]], np.int64), np.arange(len(tokens), dtype=np.int64),
                                   cache, table)
    return tokens[len(prompt):], np.stack(logits)


@torch.no_grad()
def generate_eager(model: Decoder, prompt: list[int], n: int, table: torch.Tensor):
    """The same greedy loop in torch eager."""
    cache, tokens, logits = model.new_cache(), list(prompt), []
    out, cache = model.step(torch.tensor([prompt]), torch.arange(len(prompt)), cache, table)
    for _ in range(n):
        logits.append(out[0].numpy())
        tokens.append(int(out[0].argmax()))
        out, cache = model.step(torch.tensor([[tokens[-1]]]), torch.arange(len(tokens)), cache, table)
    return tokens[len(prompt):], np.stack(logits)


def main():
    from fmha_iree.integrations.model_export import compile_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="host")
    ap.add_argument("--device", default="local-task")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--out", default="llama.vmfb")
    args = ap.parse_args()
    cfg = Config()
    model = Decoder(cfg)
    compile_model(export(model, args.target), target=args.target, output=args.out)
    print(f"wrote {args.out} (+ .json): entry points prefill, decode")
    if args.target != "host" and args.device == "local-task":
        return
    prompt = [1, 17, 42, 7, 99, 3, 250, 8, 64, 5, 11]
    table = np.random.default_rng(0).permutation(cfg.pages).astype(np.int64)  # pages in a shuffled order
    ours, lo = generate_iree(open(args.out, "rb").read(), prompt, args.tokens, table,
                             model.new_cache().numpy(), args.device)
    ref, lr = generate_eager(Decoder(cfg, attention="sdpa"), prompt, args.tokens, torch.from_numpy(table))
    print("iree  :", ours)
    print("eager :", ref)
    print(f"same tokens: {ours == ref}; max |logits - eager| = {np.abs(lo - lr).max():.2e}")


if __name__ == "__main__":
    main()
