"""Hugging Face ``transformers`` attention through fmha_iree.

:func:`register_transformers` registers :func:`attention_forward` under the name ``"fmha_iree"`` in
``transformers.AttentionInterface``, and :func:`build_mask` under the same name in
``AttentionMaskInterface``. The mask builder gives None for causal attention whose last query sits
on the last key (CK's bottom-right ``"b"``: prefill, decode, a KV-cache prefix), decided from the
lengths alone so that ``torch.compile`` and ``torch.export`` trace through it, and otherwise the
boolean mask transformers builds for SDPA. Then ``AutoModelForCausalLM.from_config(cfg,
attn_implementation="fmha_iree")``, ``from_pretrained(..., attn_implementation="fmha_iree")`` or
``model.set_attn_implementation("fmha_iree")`` run every attention layer through
``torch.ops.fmha_iree.fmha_fwd``, or, for a padded batch (prompts of different lengths, left or
right padded: :func:`padded_batch`), through group mode, ``torch.ops.fmha_iree.fmha_fwd_varlen``,
one sequence per batch row.

Nothing is registered, and transformers is not imported, until :func:`register_transformers` is
called. Inference only (no dropout, no backward), torch tensors on the CPU (see ``torch_ops``).
"""

from __future__ import annotations

import functools

import torch

from . import torch_ops
from .hf_masks import MASK_PLANS, MaskBias, PaddedBatch, ck_mask, padded_batch

__all__ = ["NAME", "register_transformers", "attention_forward", "build_mask", "ck_mask", "padded_batch",
           "PaddedBatch", "MaskBias"]

NAME = "fmha_iree"
# keyword arguments some models pass that change the attention in ways fmha_iree does not compute
_UNSUPPORTED = (
    ("position_bias", "an additive position bias"),
    ("cache", "a paged KV cache (continuous batching)"),
)


def register_transformers() -> str:
    """Register the ``"fmha_iree"`` attention implementation and its mask builder with
    transformers; returns the name. Calling it again is harmless."""
    try:
        from transformers import AttentionInterface, AttentionMaskInterface, masking_utils
    except ImportError as e:
        raise ImportError("register_transformers needs the transformers package (pip install transformers)") from e
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, functools.partial(build_mask, masking_utils))
    return NAME


def build_mask(masking_utils, *, q_length: int, kv_length: int, q_offset=0, kv_offset=0, mask_function=None,
               attention_mask=None, allow_is_causal_skip: bool = True, **kwargs):
    """transformers' mask-builder signature (as ``masking_utils.sdpa_mask``, all keywords), with
    ``masking_utils`` bound by :func:`register_transformers`.

    None where the mask is causal with the queries at the end of the keys (``q_offset + Sq ==
    kv_offset + Sk``, no padding mask): :func:`attention_forward` reads None as CK's bottom-right
    ``"b"``. Decided from the lengths alone, reading no tensor. Otherwise ``sdpa_mask``'s boolean
    mask, allowed to skip (None) only where top-left and bottom-right agree (Sq == 1, Sq == Sk):
    for a padded batch that is the ``[B, 1, Sq, Sk]`` mask with each row's padding, which
    :func:`attention_forward` reads back per batch row (:func:`padded_batch`)."""
    mu = masking_utils
    causal = mask_function is None or mask_function is mu.causal_mask_function
    ints = isinstance(q_offset, int) and isinstance(kv_offset, int)
    bottom_right = ints and q_offset + q_length == kv_offset + kv_length
    if torch.compiler.is_exporting():
        return _exported_mask(attention_mask, bottom_right)
    if allow_is_causal_skip and causal and attention_mask is None and bottom_right:
        return None
    skip = allow_is_causal_skip and (q_length == 1 or q_length == kv_length)
    return mu.sdpa_mask(q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
                        mask_function=mu.causal_mask_function if mask_function is None else mask_function,
                        attention_mask=attention_mask, allow_is_causal_skip=skip, **kwargs)


def _exported_mask(attention_mask, bottom_right: bool):
    """The mask of a model being exported: None (read by :func:`attention_forward` as the module's
    causal mask or sliding window, bottom-right), for one sequence per batch row with its queries
    at the end of its keys; a padding mask, or queries elsewhere, is a ValueError. Under export
    transformers' masks are tensors of traced values (and it cannot rule out packed sequences in
    ``position_ids``): fmha_iree's kernel takes the mask as a CK mask fixed at export, so the
    exported model serves batches without padding; group mode (``torch_ops.fmha_fwd_varlen``)
    serves sequences of their own lengths."""
    if attention_mask is not None:
        raise ValueError("attention_mask: a padding mask cannot be exported with fmha_iree attention (its CK mask is "
                         "fixed at export); export for batches without padding, or call "
                         "fmha_iree.integrations.torch_ops.fmha_fwd_varlen for sequences of their own lengths")
    if not bottom_right:
        raise ValueError("attention_mask: queries that do not end at the last key (a cache's offsets) cannot be "
                         "exported with fmha_iree attention")
    return None


def _module_mask(module, causal: bool, sq: int, sk: int, window=None) -> str:
    """The CK mask of a module's attention without a mask tensor: :func:`ck_mask`'s, within the
    sliding window the call passes (``sliding_window=``, as Mistral's and Gemma 2's attention do;
    else the module's attribute) where the attention is causal and has one (transformers: a query
    sees the ``window`` keys ending at its own position)."""
    window = getattr(module, "sliding_window", None) if window is None else window
    if causal and isinstance(window, int) and window > 0:
        return f"b:{window - 1},0"
    return ck_mask(None, causal, sq, sk)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature (as ``sdpa_attention_forward``): query
    ``[B, Hq, Sq, D]``, key / value ``[B, Hk, Sk, D]`` with ``Hq % Hk == 0`` (GQA/MQA read natively,
    K/V are not repeated); returns ``(attn_output [B, Sq, Hq, Dv], None)``.

    Without ``attention_mask``, causal (``is_causal``, else the module's ``is_causal``) is
    bottom-right (what :func:`build_mask` means by None; SDPA's top-left agrees where its own
    builder gives None: Sq == 1 or Sq == Sk). A 4-D mask that is one CK window for every batch
    row and head (:func:`ck_mask`) runs in batch mode, ``torch.ops.fmha_iree.fmha_fwd``. A padded
    batch, whose rows each see one contiguous run of keys with a causal mask or sliding window
    inside it (:func:`padded_batch`), runs in group mode: the tokens flattened to
    ``[B*Sq, Hq, D]`` / ``[B*Sk, Hk, D]``, one sequence per batch row at its physical offset
    (``seqstart_padded_q/k``), ``torch.ops.fmha_iree.fmha_fwd_varlen``. Every query row that sees
    a key gets what SDPA gives it under the same mask (right padding's pad rows included); rows
    that see none (left padding's pad rows) come back 0, never NaN.

    Gemma 2's ``softcap`` (the logits soft-cap, a constant of the compiled kernel) and gpt-oss's
    ``s_aux`` (attention sinks, ``[Hq]``: applied to the kernel's output and LSE as torch ops,
    ``paths.sinks``) are taken; the per-layer ``sliding_window`` is read where the mask is None.

    The padded path reads the mask's values to find the sequences: under ``torch.compile`` it
    graph-breaks there (``fullgraph=True`` and ``torch.export`` refuse it); models without padding
    (the mask None, see :func:`build_mask`) trace whole.

    Any other 4-D mask (a hole in a row's padding, masks differing between heads, chunked
    attention, an additive float bias) runs as an elementwise bias (``MaskBias``: a bias module,
    the mask read tile by tile; slower than a CK mask, the same result)."""
    _check_call(dropout, kwargs)
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        raise ValueError(f"query, key, value must be 4-D [B, H, S, D], got {list(query.shape)}, {list(key.shape)}, "
                         f"{list(value.shape)}")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    sq, sk = query.shape[2], key.shape[2]
    if attention_mask is None:
        plan = _module_mask(module, bool(causal), sq, sk, kwargs.get("sliding_window"))
    else:
        plan = MASK_PLANS.get(attention_mask, sq, sk)
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    if isinstance(plan, PaddedBatch):
        return _group_forward(query, key, value, plan, scaling, softcap, sinks), None
    if isinstance(plan, MaskBias):
        out = torch_ops.attention(query, key, value, scale=scaling, softcap=softcap, sinks=sinks,
                                  bias=plan.bias(query.dtype))
        return out.transpose(1, 2).contiguous(), None
    out = torch_ops.attention(query, key, value, mask=plan, scale=scaling, softcap=softcap, sinks=sinks)
    return out.transpose(1, 2).contiguous(), None


def _group_forward(query, key, value, plan: "PaddedBatch", scaling, softcap=None, sinks=None) -> torch.Tensor:
    """Group mode over the flattened batch: ``[B, Sq, Hq, Dv]``, 0 in rows no sequence owns."""
    b, hq, sq, dq = query.shape
    hk, sk, dv = key.shape[1], key.shape[2], value.shape[-1]
    starts = plan.varlen_starts()
    if starts is None:  # no batch row sees any key
        return query.new_zeros((b, sq, hq, dv))
    q = query.transpose(1, 2).reshape(b * sq, hq, dq)
    k = key.transpose(1, 2).reshape(b * sk, hk, dq)
    v = value.transpose(1, 2).reshape(b * sk, hk, dv)
    seqstart_q, seqstart_k, padded_q, padded_k = starts
    out = torch_ops.fmha_fwd_varlen(q, k, v, seqstart_q, seqstart_k, seqstart_padded_q=padded_q,
                                    seqstart_padded_k=padded_k, mask=plan.mask, scale=scaling, softcap=softcap,
                                    sinks=sinks)
    return out.reshape(b, sq, hq, dv)


def _check_call(dropout, kwargs: dict):
    if dropout:
        raise ValueError(f"dropout={dropout}: the fmha_iree attention has no dropout (run the model in eval mode)")
    for name, what in _UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise ValueError(f"{name}: the fmha_iree attention does not compute {what}; use "
                             "attn_implementation='eager' or 'sdpa' for this model")
    if kwargs.get("output_attentions"):
        raise ValueError("output_attentions=True: the fmha_iree attention returns no attention weights; use "
                         "attn_implementation='eager'")
