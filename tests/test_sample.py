"""ftrain.models.sample: generate keeps the prompt, crops the context, samples within top_k,
follows its generator, and checks its arguments."""

from functools import partial

import pytest
import torch

from ftrain.models import generate

from _tiny import tiny_gpt
from _tiny import tokens as tiny_tokens

VOCAB = 37  # odd, shared by no other dimension: a shape mix-up shows
make = partial(tiny_gpt, vocab_size=VOCAB)  # make(seed=0, **config_overrides)
tokens = partial(tiny_tokens, vocab=VOCAB)  # tokens(rows=3, length=16, seed=1)


# --- sampling ------------------------------------------------------------------------------------


def test_generate_length_keeps_prompt_and_crops_context():
    model = make().eval()
    prompt = tokens(rows=2, length=5)
    out = generate(model, prompt, 20, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 25) and out.dtype == torch.long  # 25 > seq_len: the context is cropped
    assert torch.equal(out[:, :5], prompt)
    assert out.min() >= 0 and out.max() < VOCAB
    again = generate(model, prompt, 20, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)


def test_generate_respects_top_k():
    model = make().eval()
    prompt = tokens(rows=4, length=2)
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
        generate(model, tokens(length=2), 1)
    model.eval()
    with pytest.raises(ValueError, match="top_k"):
        generate(model, tokens(length=2), 1, top_k=0)
    with pytest.raises(ValueError, match="seq_len"):
        generate(torch.nn.Identity(), tokens(length=2), 1)


def test_docstring_examples_run():
    import doctest

    import ftrain.models.sample

    result = doctest.testmod(ftrain.models.sample)
    assert result.attempted > 0 and result.failed == 0
