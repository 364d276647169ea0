"""Hugging Face transformers through fmha_iree (``fmha_iree.hf``), tested as a user would: a tiny
Llama with random weights (nothing downloaded) built with ``attn_implementation="fmha_iree"`` gives
the logits and the greedy generations of the same model on transformers' own ``"sdpa"``.

Kernel key: f32 d32 bhsd g2 (4 query heads over 2 KV heads), one module for every call.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from fmha_iree.hf import attention_forward, ck_mask, register_transformers  # noqa: E402
from reference import visible  # noqa: E402

VOCAB = 128


def _config():
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                    max_position_embeddings=128, torch_dtype="float32", pad_token_id=0,
                                    bos_token_id=1, eos_token_id=None)


@pytest.fixture(scope="module")
def models():
    """(sdpa model, fmha_iree model) with the same random weights, in eval mode; each has its own
    config (transformers sets the attention implementation on the config object it is given)."""
    assert register_transformers() == "fmha_iree"
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(_config(), attn_implementation="sdpa").eval()
    ours = transformers.AutoModelForCausalLM.from_config(_config(), attn_implementation="fmha_iree").eval()
    ours.load_state_dict(ref.state_dict())
    assert (ref.config._attn_implementation, ours.config._attn_implementation) == ("sdpa", "fmha_iree")
    return ref, ours


def _ids(seed, batch, length):
    return torch.randint(2, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_import_has_no_side_effects():
    code = ("import sys, fmha_iree, fmha_iree.torch_ops, fmha_iree.hf; "
            "assert fmha_iree.register_transformers is fmha_iree.hf.register_transformers; "
            "assert 'transformers' not in sys.modules, 'importing fmha_iree imported transformers'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_forward_logits_match_sdpa(models):
    ref, ours = models
    ids = _ids(1, 2, 11)
    with torch.no_grad(), torch.profiler.profile() as prof:
        got = ours(ids).logits
    with torch.no_grad():
        want = ref(ids).logits
    calls = [e.count for e in prof.key_averages() if e.key == "fmha_iree::fmha_fwd"]
    assert calls == [2], f"expected one fmha_iree::fmha_fwd call per layer, got {calls}"
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_generate_matches_sdpa(models):
    ref, ours = models
    ids = _ids(2, 2, 6)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    want, got = ref.generate(ids, **kw), ours.generate(ids, **kw)
    assert got.shape == (2, 14)
    assert torch.equal(got, want), f"fmha_iree generated {got.tolist()}, sdpa {want.tolist()}"


@pytest.mark.parametrize("with_mask", [False, True], ids=["no-mask", "2d-mask"])
def test_kv_cache_prefix_matches_sdpa(models, with_mask):
    """A second chunk of 3 tokens after a cached prefix of 7 (Sq 3 < Sk 10: bottom-right causal);
    with a 2-D attention mask of ones transformers materializes the 4-D mask, without one it is None."""
    ids = _ids(3, 1, 10)
    kw = dict(attention_mask=torch.ones_like(ids)) if with_mask else {}
    logits = []
    for model in models:
        cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[:, :7], past_key_values=cache, use_cache=True, **{n: x[:, :7] for n, x in kw.items()})
            logits.append(model(ids[:, 7:], past_key_values=cache, use_cache=True, **kw).logits)
    torch.testing.assert_close(logits[1], logits[0], rtol=2e-5, atol=2e-5)


class Logits(torch.nn.Module):
    """The model's logits alone (torch.export cannot return transformers' cache object)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids).logits


def test_torch_compile_and_export(models):
    """Without a padding mask, and with the KV cache the model makes itself (use_cache, the
    default), the mask is decided from lengths alone: torch.compile(fullgraph=True) and
    torch.export trace the whole model, fmha_iree's op included."""
    ref, ours = models
    ids = _ids(6, 2, 9)
    with torch.no_grad():
        want = ref(ids).logits
        compiled = torch.compile(Logits(ours), fullgraph=True, backend="aot_eager")(ids)
        ep = torch.export.export(Logits(ours), (ids,))
        exported = ep.module()(ids)
    assert "fmha_iree.fmha_fwd" in str(ep.graph)
    torch.testing.assert_close(compiled, want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(exported, want, rtol=2e-5, atol=2e-5)


def test_sliding_window_model_matches_sdpa():
    """Mistral with a 4-token sliding window over a 9-token prompt: the window masks transformers
    builds become CK windows (same kernel key as the Llama)."""
    def config():
        return transformers.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=32, sliding_window=4, max_position_embeddings=128,
                                          pad_token_id=0, bos_token_id=1, eos_token_id=None)

    torch.manual_seed(1)
    ref = transformers.AutoModelForCausalLM.from_config(config(), attn_implementation="sdpa").eval()
    ours = transformers.AutoModelForCausalLM.from_config(config(), attn_implementation="fmha_iree").eval()
    ours.load_state_dict(ref.state_dict())
    ids = _ids(7, 2, 9)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, rtol=2e-5, atol=2e-5)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert torch.equal(ours.generate(ids, **kw), ref.generate(ids, **kw))


def test_padded_batch_is_refused(models):
    _, ours = models
    ids = _ids(4, 2, 6)
    padding = torch.ones_like(ids)
    padding[0, :2] = 0  # left padding in one row only
    with pytest.raises(ValueError, match="attention_mask"):
        with torch.no_grad():
            ours(ids, attention_mask=padding)


def _hf_mask(q_length, kv_length, q_offset=0, window=None):
    """The boolean 4-D mask transformers' own builder makes (True: attend)."""
    from transformers import masking_utils as mu

    fn = mu.causal_mask_function if window is None else mu.sliding_window_causal_mask_function(window)
    return mu.sdpa_mask(batch_size=2, q_length=q_length, kv_length=kv_length, q_offset=q_offset, mask_function=fn,
                        allow_is_causal_skip=False)


MASKS = [  # (id, Sq, Sk, q_offset, sliding window)
    ("causal", 8, 8, 0, None),
    ("kv-prefix", 3, 10, 7, None),
    ("decode", 1, 10, 9, None),
    ("window", 9, 9, 0, 4),
    ("window-decode", 1, 12, 11, 4),
    ("window-prefix", 3, 12, 9, 5),
]


@pytest.mark.parametrize("name,sq,sk,offset,window", MASKS, ids=[m[0] for m in MASKS])
def test_ck_mask_of_transformers_masks(name, sq, sk, offset, window):
    """Each mask transformers builds becomes a CK mask string that sees exactly the same keys
    (reference.visible reads the string independently of fmha_iree); its additive float form too."""
    m = _hf_mask(sq, sk, offset, window)
    for form in (m, torch.where(m, 0.0, torch.finfo(torch.float32).min)):
        text = ck_mask(form, True, sq, sk)
        np.testing.assert_array_equal(visible(text, sq, sk), m[0, 0].numpy(), err_msg=f"{name}: {text}")


def test_ck_mask_without_a_mask_is_bottom_right_causal():
    """None (what the registered mask builder gives for causal masks whose last query sits on the
    last key) is bottom-right causal; one query sees every key."""
    i, j = np.arange(3)[:, None], np.arange(10)[None, :]
    np.testing.assert_array_equal(visible(ck_mask(None, True, 3, 10), 3, 10), j <= i + 7)
    np.testing.assert_array_equal(visible(ck_mask(None, True, 5, 5), 5, 5), np.tril(np.ones((5, 5), bool)))
    assert visible(ck_mask(None, True, 1, 9), 1, 9).all()
    assert visible(ck_mask(None, False, 5, 9), 5, 9).all()


def test_ck_mask_refuses_what_it_cannot_express():
    m = _hf_mask(6, 6).clone()
    m[1, 0, :, 0] = False  # padding in batch row 1 only
    with pytest.raises(ValueError, match="attention_mask differs between batch rows"):
        ck_mask(m, True, 6, 6)
    bias = torch.zeros(1, 1, 6, 6)
    bias[0, 0, 2, 3] = -1.5
    with pytest.raises(ValueError, match="attention_mask: an additive float mask"):
        ck_mask(bias, True, 6, 6)
    with pytest.raises(ValueError, match="attention_mask"):
        ck_mask(torch.rand(1, 1, 6, 6, generator=torch.Generator().manual_seed(5)) > 0.5, True, 6, 6)
    with pytest.raises(ValueError, match="attention_mask"):
        ck_mask(m[:, :, :5], True, 6, 6)


def test_unsupported_arguments_are_refused():
    q = torch.zeros(1, 4, 3, 32)
    kv = torch.zeros(1, 2, 3, 32)
    layer = torch.nn.Module()
    for kw, word in ((dict(dropout=0.1), "dropout"), (dict(softcap=30.0), "softcap"),
                     (dict(output_attentions=True), "output_attentions")):
        with pytest.raises(ValueError, match=word):
            attention_forward(layer, q, kv, kv, None, **kw)
