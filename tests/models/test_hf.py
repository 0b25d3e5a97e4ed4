"""Any nn.Module works: a Hugging Face GPT-2 built from a local config trains through ft.apply,
and the params ftrain saves load back into a plain transformers model."""

import pytest
import torch

import ftrain as ft
from ftrain.models import load_causal_lm

from _hf import tiny_hf_dir
from _tiny import lm_batch

transformers = pytest.importorskip("transformers")


def _model():
    from ftrain.models import tiny_gpt2

    torch.manual_seed(0)
    return tiny_gpt2(n_positions=32, n_embd=32, n_layer=2, n_head=2)


def _loss_fn(model):
    def loss_fn(params, batch):
        logits = ft.apply(model, params, batch["input"]).logits
        return ft.losses.cross_entropy(logits, batch["target"])

    return loss_fn


def _batch(seed=0):
    return lm_batch(4, seed, vocab=257)


def test_hf_gpt2_trains_with_ft_apply():
    model = _model()
    opt = ft.optim.adamw(3e-3)
    state = ft.TrainState.create(ft.params_of(model), opt)
    step = ft.train_step(_loss_fn(model), opt)
    batch = _batch()
    losses = []
    for _ in range(8):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    assert losses[-1] < losses[0] - 0.5, losses
    # The template's own tensors were never touched.
    fresh = _model()
    for (k, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), k


def test_hf_gpt2_params_round_trip_through_ft_save(tmp_path):
    from safetensors.torch import load_file

    model = _model()
    opt = ft.optim.adamw(3e-3)
    state = ft.TrainState.create(ft.params_of(model), opt)
    state, _ = ft.train_step(_loss_fn(model), opt)(state, _batch())
    ft.save(state, tmp_path / "ckpt")
    plain = _model()
    # GPT-2 ties lm_head.weight to transformer.wte.weight; params keep the first name only,
    # so strict=False and the tie fills in the head.
    missing, unexpected = plain.load_state_dict(
        load_file(tmp_path / "ckpt" / "params.safetensors"), strict=False
    )
    assert unexpected == []
    assert set(missing) <= {"lm_head.weight"}
    x = _batch(1)["input"]
    plain.eval()
    model.eval()
    with torch.no_grad():
        want = ft.apply(model, state.params, x).logits
        got = plain(x).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_tiny_gpt2_builds_a_small_stateless_template():
    from ftrain.models import num_params, tiny_gpt2

    model = tiny_gpt2(n_positions=16)
    idx = torch.randint(0, 257, (3, 16), generator=torch.Generator().manual_seed(1))
    assert model(idx).logits.shape == (3, 16, 257)
    assert num_params(model) < 200_000
    params = {k: torch.zeros_like(v) for k, v in model.named_parameters()}
    out = torch.func.functional_call(model, params, (idx,)).logits
    assert torch.equal(out, torch.zeros_like(out))  # usable as a stateless template


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_load_causal_lm_reads_a_save_pretrained_folder_offline(tmp_path, kind):
    folder = tiny_hf_dir(tmp_path / kind, kind)
    model = load_causal_lm(folder)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert model.training and not model.config.use_cache
    assert next(model.parameters()).dtype == torch.float32
    assert not getattr(model, "use_kernels", False)  # transformers 5's Hub kernels stay off
    x = torch.randint(
        0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0)
    )
    ref.eval()
    with torch.no_grad():
        want = ref(x).logits
        got = ft.apply(model.eval(), ft.params_of(model), x).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_load_causal_lm_refuses_a_folder_without_config_or_safetensors(tmp_path):
    with pytest.raises(FileNotFoundError, match="--model-dir .* is not a directory"):
        load_causal_lm(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_causal_lm(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors.*safe_serialization"):
        load_causal_lm(tmp_path)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_packed_rows_give_each_document_its_losses_alone(tmp_path, kind):
    """--pack with a Hugging Face model: given position_ids restarting at each document (and no
    attention mask), transformers keeps attention within documents; checked per token."""
    from ftrain import data

    from _hf import CORPUS, packed_and_alone

    folder = tiny_hf_dir(tmp_path / kind, kind)
    model = load_causal_lm(folder).eval()
    tok = data.load_tokenizer(folder)
    texts = [(str(i), t) for i, t in enumerate(CORPUS[:5] * 3)]
    data.build_token_dataset(texts, tmp_path / "tokens", tok, progress=False)
    rows = data.TokenDataset(tmp_path / "tokens", 48, seed=0, pack=True, splits=(1, 0, 0))

    def logits(x, pos):
        return (model(x) if pos is None else model(x, position_ids=pos)).logits

    for i in range(2):
        packed, alone, docs = packed_and_alone(logits, rows[i])
        assert docs >= 2
        torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)
    leaky, alone, _ = packed_and_alone(lambda x, pos: model(x).logits, rows[0])
    assert (leaky - alone).abs().max() > 1e-3  # without position_ids, documents see each other


def test_attn_implementation_reaches_the_model_and_bad_ones_are_refused(tmp_path):
    """--attn-implementation: eager and sdpa load the kernel they name with the same logits;
    an unknown name, flash_attention_2 without flash-attn, or no --model-dir, a clear error."""
    import importlib.util

    from ftrain.app.config import TrainConfig

    folder = tiny_hf_dir(tmp_path / "m", "llama")
    x = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = {}
    for name in ("eager", "sdpa"):
        model = load_causal_lm(folder, attn_implementation=name).eval()
        assert model.config._attn_implementation == name
        with torch.no_grad():
            logits[name] = model(x).logits
    torch.testing.assert_close(logits["eager"], logits["sdpa"], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="must be one of sdpa, eager, flash_attention_2"):
        TrainConfig(model_dir=str(folder), attn_implementation="flash").validate()
    with pytest.raises(ValueError, match="applies to a --model-dir model"):
        TrainConfig(attn_implementation="eager").validate()
    if importlib.util.find_spec("flash_attn") is None:
        with pytest.raises(ValueError, match="needs the flash-attn package.* use --attn-impl"):
            TrainConfig(model_dir=str(folder), attn_implementation="flash_attention_2").validate()
