"""pola_lm_*: generation through each layer's step() (the recurrent form, a KV cache for softmax) picks the same
tokens as the parallel forward pass, also past the context, where the window restarts from its newest half."""
from __future__ import annotations

import pytest
import timm
import torch

import polaformer.models  # noqa: F401  (registers pola_lm_*)


def _greedy_parallel(model, prompt, new_tokens):
    """Greedy decoding with a full forward pass over the window per token (the reference of generate)."""
    tokens, start = prompt, max(0, prompt.shape[1] - model.context)
    for _ in range(new_tokens):
        if tokens.shape[1] - start > model.context:
            start = tokens.shape[1] - model.context // 2
        logits = model(tokens[:, start:])[:, -1]
        tokens = torch.cat([tokens, logits.argmax(dim=-1, keepdim=True)], dim=1)
    return tokens


@pytest.mark.parametrize("attention", ["pola", "pacs", "elu", "softmax"])
def test_recurrent_generation_equals_parallel_token_for_token(attention):
    torch.manual_seed(0)
    model = timm.create_model("pola_lm_tiny", attention=attention, context=12,
                              attention_kwargs=None if attention in ("elu", "softmax") else {"chunk_size": 4})
    model = model.double().eval()
    with torch.no_grad():  # larger logits than the 0.02 init, so the greedy choice is never a near tie
        model.tok_embed.weight.mul_(50)
    prompt = torch.randint(0, 256, (2, 5))
    generated = model.generate(prompt, 20, temperature=0)  # 5 + 20 tokens: the window restarts twice
    assert generated.shape == (2, 25)
    assert torch.equal(generated[:, :5], prompt)
    with torch.no_grad():
        assert torch.equal(generated, _greedy_parallel(model, prompt, 20))


def test_generate_refuses_an_empty_prompt():
    model = timm.create_model("pola_lm_tiny", context=8)
    with pytest.raises(ValueError, match="at least one token"):
        model.generate(torch.zeros(1, 0, dtype=torch.long), 3)
