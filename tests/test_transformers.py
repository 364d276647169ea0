"""Hugging Face transformers through fmha_iree (``fmha_iree.integrations.hf``), tested as a user would: a tiny
Llama with random weights (nothing downloaded) built with ``attn_implementation="fmha_iree"`` gives
the logits and the greedy generations of the same model on transformers' own ``"sdpa"``.

Kernel keys: f32 d32 g2 (4 query heads over 2 KV heads), bhsd for batch mode (every call without
padding) and bshd for group mode (padded batches, one sequence per batch row): two modules.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from fmha_iree.integrations.hf import attention_forward, ck_mask, padded_batch, register_transformers  # noqa: E402
from reference import assert_close, to_f64, visible  # noqa: E402

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
    code = ("import sys, fmha_iree, fmha_iree.integrations.torch_ops, fmha_iree.integrations.hf; "
            "assert fmha_iree.register_transformers is fmha_iree.integrations.hf.register_transformers; "
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


def _padded(lengths, side="left", total=None):
    """Token ids and the 2-D attention mask of prompts of these lengths padded to ``total`` (the
    longest by default) with pad id 0 on ``side``."""
    total = max(lengths) if total is None else total
    ids = _ids(8, len(lengths), total)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        (mask[b, total - n:] if side == "left" else mask[b, :n]).fill_(1)
    return ids.masked_fill(mask == 0, 0), mask


def test_padded_generate_matches_sdpa(models):
    """Batched greedy generation of prompts of lengths 5, 9 and 2, left padded (transformers'
    padding for decoder-only generation): group mode, one sequence per batch row, in the prefill
    and in every decode step; the tokens are sdpa's."""
    ref, ours = models
    ids, mask = _padded([5, 9, 2])
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    with torch.profiler.profile() as prof:
        got = ours.generate(ids, **kw)
    want = ref.generate(ids, **kw)
    calls = {e.key: e.count for e in prof.key_averages() if e.key.startswith("fmha_iree::")}
    assert calls == {"fmha_iree::fmha_fwd_varlen": 2 * 6}, calls  # prefill + 5 decode steps, 2 layers
    assert got.shape == (3, 15)
    assert torch.equal(got, want), f"fmha_iree generated {got.tolist()}, sdpa {want.tolist()}"


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_logits_match_sdpa(models, side):
    """A padded batch's logits at the prompts' own positions (padding positions are ignored by
    transformers) match sdpa's at f32 tolerances; nothing is NaN."""
    ref, ours = models
    ids, mask = _padded([7, 3, 10, 1], side)
    with torch.no_grad():
        got, want = ours(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits
    assert not got.isnan().any()
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], rtol=2e-5, atol=2e-5)


def test_hole_in_the_padding_runs_as_a_bias(models):
    """A 2-D mask with a hole in the middle of a row is no run of keys (no CK mask, no padded
    batch): it runs as an elementwise bias, and the logits at the prompts' positions are sdpa's."""
    ref, ours = models
    ids, mask = _padded([6, 4], "left")
    mask[0, 3] = 0
    with torch.no_grad(), torch.profiler.profile() as prof:
        got = ours(ids, attention_mask=mask).logits
    want = ref(ids, attention_mask=mask).logits
    calls = {e.key: e.count for e in prof.key_averages() if e.key.startswith("fmha_iree::")}
    assert calls == {"fmha_iree::fmha_fwd": 2}, calls  # one call per layer, the mask as a bias
    valid = mask.bool()
    assert not got[valid].isnan().any()
    torch.testing.assert_close(got[valid], want[valid], rtol=2e-5, atol=2e-5)


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


def _hf_padded_mask(padding, q_length, kv_length, q_offset=0, window=None):
    """transformers' boolean 4-D mask for a batch with this 2-D padding mask ``[B, kv_offset + Sk]``
    (the mask its own sdpa builder makes, never skipped)."""
    from transformers import masking_utils as mu

    fn = mu.causal_mask_function if window is None else mu.sliding_window_causal_mask_function(window)
    return mu.sdpa_mask(batch_size=padding.shape[0], q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                        mask_function=fn, attention_mask=padding.bool(), allow_is_causal_skip=False)


def _rows(lengths, side, total):
    return _padded(lengths, side, total)[1]


def _grow(padding, n):
    """The 2-D mask after ``n`` generated tokens (what generate appends)."""
    return torch.cat([padding, torch.ones(padding.shape[0], n, dtype=padding.dtype)], 1)


PADDED = [  # (id, 2-D padding mask [B, q_offset + Sq or more], Sq, Sk, q_offset, sliding window)
    ("left-prefill", _rows([5, 9, 2], "left", 9), 9, 9, 0, None),
    ("right-prefill", _rows([5, 9, 2], "right", 9), 9, 9, 0, None),
    ("left-decode", _grow(_rows([5, 9, 2], "left", 9), 3), 1, 12, 11, None),
    ("left-chunk", _rows([5, 9, 2], "left", 9), 3, 9, 6, None),  # 3 queries after 6 cached tokens
    ("static-cache", _rows([5, 9, 2], "left", 9), 9, 16, 0, None),  # keys 9.. not written yet
    ("one-row", _rows([4], "left", 9), 9, 9, 0, None),
    ("left-window", _rows([5, 9, 2], "left", 9), 9, 9, 0, 4),
    ("right-window", _rows([5, 9, 2], "right", 9), 9, 9, 0, 4),
    ("left-window-decode", _grow(_rows([5, 9, 2], "left", 9), 1), 1, 10, 9, 4),
    ("left-window-chunk", _grow(_rows([5, 9, 2], "left", 9), 1), 3, 10, 7, 4),
]


@pytest.mark.parametrize("name,padding,sq,sk,offset,window", PADDED, ids=[c[0] for c in PADDED])
def test_padded_batch_reads_transformers_masks(name, padding, sq, sk, offset, window):
    """Each padded mask transformers builds becomes one sequence per batch row whose CK mask,
    applied with the sequence's own lengths at its offsets (reference.visible, independent of
    fmha_iree), shows exactly the keys the mask shows, in every row of every batch row; rows
    outside a sequence see no key. The additive float form reads the same."""
    m = _hf_padded_mask(padding, sq, sk, offset, window)
    p = padded_batch(m, sq, sk)
    assert p == padded_batch(torch.where(m, 0.0, torch.finfo(torch.float32).min), sq, sk)
    for b in range(m.shape[0]):
        got = np.zeros((sq, sk), bool)
        nq, nk = p.q_end[b] - p.q_start[b], p.k_end[b] - p.k_start[b]
        got[p.q_start[b]:p.q_end[b], p.k_start[b]:p.k_end[b]] = visible(p.mask, nq, nk)
        np.testing.assert_array_equal(got, m[b, 0].numpy(), err_msg=f"{name}: batch row {b} as {p}")
    if name.startswith("left") and window is None:  # left padding: bottom-right causal from the first real key
        assert p.mask in ("b", "0") and list(p.k_start) == [int(x) for x in (padding[:, :sk] == 0).sum(1)]


def _masked_attention(q, k, v, mask):
    """float64 softmax attention under a boolean 4-D mask (GQA: query head h reads KV head
    h // (Hq // Hk)): [B, Sq, Hq, Dv], and the rows that see some key."""
    q, k, v = to_f64(q), to_f64(k), to_f64(v)
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat(g, axis=1), v.repeat(g, axis=1)
    m = mask.numpy()[:, :1]
    s = np.where(m, q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1]), -np.inf)
    sees = m.any(-1)  # [B, 1, Sq]
    p = np.exp(s - np.where(sees, s.max(-1), 0)[..., None])
    out = (p @ v) / np.where(sees, p.sum(-1), 1)[..., None]
    return out.transpose(0, 2, 1, 3), sees[:, 0]


@pytest.mark.parametrize("name,padding,sq,sk,offset,window", PADDED, ids=[c[0] for c in PADDED])
def test_padded_attention_matches_float64(name, padding, sq, sk, offset, window):
    """attention_forward on a padded batch (group mode over the flattened tokens) against float64
    attention under the mask itself: every query row that sees a key matches at f32 tolerances,
    the others are 0 (never NaN)."""
    m = _hf_padded_mask(padding, sq, sk, offset, window)
    g = torch.Generator().manual_seed(len(name))
    b = m.shape[0]
    q = torch.randn(b, 4, sq, 32, generator=g)
    k, v = torch.randn(b, 2, sk, 32, generator=g), torch.randn(b, 2, sk, 32, generator=g)
    with torch.profiler.profile() as prof:
        out, _ = attention_forward(torch.nn.Module(), q, k, v, m)
    assert [e.key for e in prof.key_averages() if e.key.startswith("fmha_iree::")] == ["fmha_iree::fmha_fwd_varlen"]
    want, sees = _masked_attention(q, k, v, m)
    assert out.shape == (b, sq, 4, 32) and out.dtype == torch.float32
    assert_close(out[torch.from_numpy(sees)], want[sees], torch.float32, what=name)
    assert not out[torch.from_numpy(~sees)].any(), f"{name}: rows that see no key must be 0"


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



def test_padded_batch_refuses_what_group_mode_cannot_express():
    """One contiguous run of keys per batch row with one causal / window mask over it, the same for
    every head: anything else is a ValueError naming attention_mask."""
    padding = _rows([6, 4], "left", 6)
    hole = padding.clone()
    hole[0, 2] = 0  # a hole in the middle of row 0's keys
    with pytest.raises(ValueError, match="attention_mask: batch row 0 sees keys 0..5 but no query sees key 2"):
        padded_batch(_hf_padded_mask(hole, 6, 6), 6, 6)
    m = _hf_padded_mask(padding, 6, 6).clone()
    m[0, 0, 5, 2] = False  # the last query of row 0 skips a key the others see
    with pytest.raises(ValueError, match="attention_mask: query row 5 of batch row 0 sees more than one run"):
        padded_batch(m, 6, 6)
    heads = _hf_padded_mask(padding, 6, 6).expand(2, 2, 6, 6).clone()
    heads[1, 1] = True
    with pytest.raises(ValueError, match="attention_mask differs between heads"):
        padded_batch(heads, 6, 6)
    mixed = torch.cat([_hf_padded_mask(padding[:1], 6, 6), _hf_padded_mask(padding[1:], 6, 6, window=2)])
    with pytest.raises(ValueError, match="attention_mask: the batch rows are not one CK mask"):
        padded_batch(mixed, 6, 6)
    # attention_forward runs what neither expresses as an elementwise bias: SDPA's result on every
    # row that sees a key; it reads a mask once for all layers, but again once it changes in place
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 4, 6, 32, generator=g), torch.randn(2, 2, 6, 32, generator=g), torch.randn(2, 2, 6, 32,
                                                                                                         generator=g)
    m = _hf_padded_mask(padding, 6, 6).clone()
    for mask in (mixed, m, None):
        if mask is None:
            m[0, 0, 5, 2] = False
            mask = m
        got = attention_forward(torch.nn.Module(), q, k, v, mask)[0].transpose(1, 2)
        want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                                attn_mask=mask)
        sees = mask.expand(2, 4, 6, 6).any(-1)
        assert_close(got[sees], want[sees].numpy(), torch.float32, what="attention_forward, a mask as a bias")
        assert not got[~sees].any()


def test_unsupported_arguments_are_refused():
    q = torch.zeros(1, 4, 3, 32)
    kv = torch.zeros(1, 2, 3, 32)
    layer = torch.nn.Module()
    for kw, word in ((dict(dropout=0.1), "dropout"), (dict(position_bias=torch.zeros(1)), "position_bias"),
                     (dict(output_attentions=True), "output_attentions")):
        with pytest.raises(ValueError, match=word):
            attention_forward(layer, q, kv, kv, None, **kw)
