"""transformers models whose attention has more than a mask, through fmha_iree: a tiny Gemma 2
(logits soft-cap, sliding windows on alternate layers) and a tiny gpt-oss (attention sinks,
alternate sliding windows), random weights built from local configs, against the same models on
transformers' own ``"eager"`` attention: logits and greedy tokens, without padding (batch mode) and
left padded (group mode)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fmha_iree.integrations.hf import register_transformers  # noqa: E402

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=None)


def _gemma2():
    return transformers.Gemma2Config(intermediate_size=128, sliding_window=4, attn_logit_softcapping=2.0,
                                     final_logit_softcapping=30.0, query_pre_attn_scalar=32, **COMMON)


def _gpt_oss():
    return transformers.GptOssConfig(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                                     sliding_window=4, layer_types=["sliding_attention", "full_attention"], **COMMON)


def _pair(config, seed):
    """(eager model, fmha_iree model) with the same random weights; gpt-oss's sinks and the query
    projections drawn large enough for the variants to matter."""
    assert register_transformers() == "fmha_iree"
    torch.manual_seed(seed)
    ref = transformers.AutoModelForCausalLM.from_config(config(), attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("sinks"):
                torch.nn.init.normal_(p, mean=1.0, std=2.0)
            elif name.endswith("q_proj.weight"):  # scores of a few units: the cap bends them
                p.mul_(16.0)
    ours = transformers.AutoModelForCausalLM.from_config(config(), attn_implementation="fmha_iree").eval()
    ours.load_state_dict(ref.state_dict())
    return ref, ours


@pytest.fixture(scope="module", params=["gemma2", "gpt_oss"])
def pair(request):
    return _pair(_gemma2 if request.param == "gemma2" else _gpt_oss, 3)


def _ids(seed, batch, length):
    return torch.randint(2, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_logits_and_tokens_match_eager(pair):
    ref, ours = pair
    ids = _ids(1, 2, 11)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-4)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    assert torch.equal(ours.generate(ids, **kw), ref.generate(ids, **kw))


def test_padded_tokens_match_eager(pair):
    """Prompts of lengths 5, 9 and 2, left padded: group mode with the cap or the sinks."""
    ref, ours = pair
    lengths, total = [5, 9, 2], 9
    ids = _ids(8, 3, total)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        mask[b, total - n:] = 1
    ids = ids.masked_fill(mask == 0, 0)
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False)
    with torch.no_grad():
        got, want = ours(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-4, atol=1e-4)
    assert torch.equal(ours.generate(ids, **kw), ref.generate(ids, **kw))


def test_sinks_and_softcap_move_the_logits():
    """The variants are not no-ops in these configs: without them the eager logits differ."""
    for config, attr in ((_gemma2, "attn_logit_softcapping"), (_gpt_oss, None)):
        ref, _ = _pair(config, 3)
        ids = _ids(1, 1, 11)
        with torch.no_grad():
            base = ref(ids).logits
            if attr:
                for layer in ref.model.layers:
                    layer.self_attn.attn_logit_softcapping = None
            else:
                for layer in ref.model.layers:
                    layer.self_attn.sinks.data.fill_(-1e4)
            assert (ref(ids).logits - base).abs().max() > 1e-2
