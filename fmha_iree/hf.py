"""Hugging Face ``transformers`` attention through fmha_iree.

:func:`register_transformers` registers :func:`attention_forward` under the name ``"fmha_iree"`` in
``transformers.AttentionInterface``, and :func:`build_mask` under the same name in
``AttentionMaskInterface``. The mask builder gives None for causal attention whose last query sits
on the last key (CK's bottom-right ``"b"``: prefill, decode, a KV-cache prefix), decided from the
lengths alone so that ``torch.compile`` and ``torch.export`` trace through it, and otherwise the
boolean mask transformers builds for SDPA. Then ``AutoModelForCausalLM.from_config(cfg,
attn_implementation="fmha_iree")``, ``from_pretrained(..., attn_implementation="fmha_iree")`` or
``model.set_attn_implementation("fmha_iree")`` run every attention layer through
``torch.ops.fmha_iree.fmha_fwd``.

Nothing is registered, and transformers is not imported, until :func:`register_transformers` is
called. Inference only (no dropout, no backward), torch tensors on the CPU (see ``torch_ops``).
"""

from __future__ import annotations

import functools

import torch

from . import torch_ops

__all__ = ["NAME", "register_transformers", "attention_forward", "build_mask", "ck_mask"]

NAME = "fmha_iree"
# keyword arguments some models pass that change the attention in ways fmha_iree does not compute
_UNSUPPORTED = (
    ("softcap", "logit soft-capping"),
    ("s_aux", "attention sinks"),
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
    mask, allowed to skip (None) only where top-left and bottom-right agree (Sq == 1, Sq == Sk)."""
    mu = masking_utils
    causal = mask_function is None or mask_function is mu.causal_mask_function
    ints = isinstance(q_offset, int) and isinstance(kv_offset, int)
    bottom_right = ints and q_offset + q_length == kv_offset + kv_length
    if allow_is_causal_skip and causal and attention_mask is None and bottom_right:
        return None
    skip = allow_is_causal_skip and (q_length == 1 or q_length == kv_length)
    return mu.sdpa_mask(q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
                        mask_function=mu.causal_mask_function if mask_function is None else mask_function,
                        attention_mask=attention_mask, allow_is_causal_skip=skip, **kwargs)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature (as ``sdpa_attention_forward``): query
    ``[B, Hq, Sq, D]``, key / value ``[B, Hk, Sk, D]`` with ``Hq % Hk == 0`` (GQA/MQA read natively,
    K/V are not repeated); returns ``(attn_output [B, Sq, Hq, Dv], None)``.

    Without ``attention_mask``, causal (``is_causal``, else the module's ``is_causal``) is
    bottom-right (what :func:`build_mask` means by None; SDPA's top-left agrees where its own
    builder gives None: Sq == 1 or Sq == Sk); a 4-D mask (see :func:`ck_mask`) becomes a CK window."""
    _check_call(dropout, kwargs)
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        raise ValueError(f"query, key, value must be 4-D [B, H, S, D], got {list(query.shape)}, {list(key.shape)}, "
                         f"{list(value.shape)}")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    mask = ck_mask(attention_mask, bool(causal), query.shape[2], key.shape[2])
    out, _ = torch.ops.fmha_iree.fmha_fwd(query, key, value, mask, scaling, "bhsd")
    return out.transpose(1, 2).contiguous(), None


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


def ck_mask(attention_mask: torch.Tensor | None, is_causal: bool, sq: int, sk: int) -> str:
    """The CK mask string of a transformers attention mask.

    ``None``: ``"b"`` (bottom-right causal) when ``is_causal`` and ``Sq > 1``, else ``"0"``. A 4-D
    ``[B, 1 or H, Sq, Sk]`` mask, boolean (True: attend) or additive float (0 and -inf / the dtype's
    minimum), must be the same for every batch row and head and one window per row
    (:func:`fmha_iree.torch_ops.mask_of`, top-left or bottom-right); padding masks that differ
    between batch rows, and other patterns, are a ``ValueError`` naming ``attention_mask``."""
    if attention_mask is None:
        return "b" if is_causal and sq > 1 else "0"
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be None or a 4-D torch.Tensor, got {type(attention_mask).__name__}")
    if attention_mask.ndim != 4 or tuple(attention_mask.shape[-2:]) != (sq, sk):
        raise ValueError(f"attention_mask must be [B, 1 or H, Sq, Sk] with Sq, Sk = {sq}, {sk}, got "
                         f"{list(attention_mask.shape)}")
    rows = _visible(attention_mask).reshape(-1, sq, sk)
    if rows.shape[0] > 1 and not bool((rows == rows[:1]).all()):
        raise ValueError("attention_mask differs between batch rows or heads (padding): the fmha_iree attention "
                         "takes one mask for the whole batch; pass unpadded sequences of one length (or run them one "
                         "by one), or use attn_implementation='sdpa'")
    try:
        return torch_ops.mask_of(rows[0], False, sq, sk)
    except ValueError as e:
        raise ValueError(f"attention_mask: {e}") from None


def _visible(mask: torch.Tensor) -> torch.Tensor:
    """A boolean (True: attend) copy of a boolean or additive float mask, on the CPU."""
    mask = mask.detach().cpu()
    if mask.dtype == torch.bool:
        return mask
    if not mask.dtype.is_floating_point:
        raise TypeError(f"attention_mask must be boolean or floating point, got {mask.dtype}")
    masked = mask <= torch.finfo(mask.dtype).min / 2
    if not bool(((mask == 0) | masked).all()):
        raise ValueError("attention_mask: an additive float mask with values other than 0 and -inf (a bias) is not "
                         "taken by the fmha_iree attention; use attn_implementation='sdpa'")
    return ~masked
