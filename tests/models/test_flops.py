"""ftrain.models.flops: parameter and FLOP counts, checked against the formulas written out by hand
for a small GPT."""

from ftrain.models import GPT, GPTConfig, flops_per_token, matmul_params_per_token, num_params

SMALL = dict(vocab_size=37, seq_len=16, d_model=32, n_layer=2, n_head=4)


# --- counting ------------------------------------------------------------------------------------


def test_num_params_counts_every_parameter_once():
    cfg = GPTConfig(**SMALL)
    d, V, T, L, h = 32, 37, 16, 2, 128
    block = (2 * 2 * d) + (3 * d * d + 3 * d) + (d * d + d) + (d * h + h) + (h * d + d)
    assert num_params(GPT(cfg)) == V * d + T * d + L * block + 2 * d


def test_flops_per_token():
    cfg = GPTConfig(**SMALL)
    d, V, T, L, h = 32, 37, 16, 2, 128
    assert matmul_params_per_token(cfg) == L * (4 * d * d + 2 * d * h) + d * V
    assert flops_per_token(cfg) == 6 * matmul_params_per_token(cfg) + 12 * L * d * T
    assert flops_per_token(cfg, seq_len=8) == flops_per_token(cfg) - 12 * L * d * 8
    moe = GPTConfig(**SMALL, n_experts=8, top_k=2)  # only the experts a token visits count
    assert matmul_params_per_token(moe) == matmul_params_per_token(cfg) + L * (2 * d * h + d * 8)
    assert num_params(GPT(moe)) > num_params(GPT(cfg)) + L * 6 * 2 * d * h


def test_docstring_examples_run():
    import doctest

    import ftrain.models.flops

    result = doctest.testmod(ftrain.models.flops)
    assert result.attempted > 0 and result.failed == 0
