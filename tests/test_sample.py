"""ftrain.models.sample: generate keeps the prompt, crops the context, samples within top_k,
follows its generator, and checks its arguments."""

import pytest
import torch

from ftrain.models import GPT, GPTConfig, generate

SMALL = dict(vocab_size=37, seq_len=16, d_model=32, n_layer=2, n_head=4)


def make(seed=0, **overrides):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**SMALL, **overrides}))


def tokens(B=3, T=16, vocab=37, seed=1):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


# --- sampling ------------------------------------------------------------------------------------


def test_generate_length_keeps_prompt_and_crops_context():
    model = make().eval()
    prompt = tokens(B=2, T=5)
    out = generate(model, prompt, 20, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 25) and out.dtype == torch.long  # 25 > seq_len: the context is cropped
    assert torch.equal(out[:, :5], prompt)
    assert out.min() >= 0 and out.max() < 37
    again = generate(model, prompt, 20, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)


def test_generate_respects_top_k():
    model = make().eval()
    prompt = tokens(B=4, T=2)
    greedy = generate(model, prompt, 10, temperature=0.0)
    assert torch.equal(generate(model, prompt, 10, top_k=1), greedy)
    out = generate(model, prompt, 12, temperature=2.0, top_k=3, generator=torch.Generator())
    with torch.no_grad():
        logits = model(out[:, :-1])  # logits[:, t] predicted out[:, t + 1]
    top3 = logits[:, 1:].topk(3, dim=-1).indices  # the steps that sampled
    assert (top3 == out[:, 2:, None]).any(-1).all()
    wide = generate(model, prompt, 12, temperature=2.0, generator=torch.Generator())
    with torch.no_grad():
        top3 = model(wide[:, :-1])[:, 1:].topk(3, dim=-1).indices
    assert not (top3 == wide[:, 2:, None]).any(-1).all()  # without top_k, others do get sampled


def test_generate_warns_in_training_mode_and_checks_arguments():
    model = make().train()
    with pytest.warns(UserWarning, match="eval"):
        generate(model, tokens(T=2), 1)
    model.eval()
    with pytest.raises(ValueError, match="top_k"):
        generate(model, tokens(T=2), 1, top_k=0)
    with pytest.raises(ValueError, match="seq_len"):
        generate(torch.nn.Identity(), tokens(T=2), 1)


def test_docstring_examples_run():
    import doctest

    import ftrain.models.sample

    result = doctest.testmod(ftrain.models.sample)
    assert result.attempted > 0 and result.failed == 0
