"""ft.lora and ft.merge_lora: against peft's LoRA, merged against adapted, the optimizer state it
keeps, and its composition with the other transforms (shard: the session's 2-rank run)."""

from __future__ import annotations

import copy

import pytest
import torch

import ftrain as ft
from ftrain import tree
from ftrain.testing import assert_one_graph, assert_steps_close, saved_activation_bytes

from _tiny import assert_trees_close, lm_batch, lm_loss, tiny_gpt

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def tiny_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        use_cache=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def hf_loss(model):
    def loss_fn(params, batch):
        logits = ft.apply(model, params, batch["input"]).logits
        return ft.losses.cross_entropy(logits, batch["target"])

    return loss_fn


# name: (model, loss, targets, peft's fan_in_fan_out)
MODELS = {
    "gpt": (lambda: tiny_gpt(), lm_loss, ["attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"], False),
    # GPT-2's layers are Conv1D, weights stored (in, out)
    "gpt2": (
        lambda: ft.models.hf.tiny_gpt2(vocab_size=64, n_positions=16, n_embd=32),
        hf_loss,
        ["c_attn", "c_proj", "c_fc"],
        True,
    ),
    "llama": (tiny_llama, hf_loss, ["q_proj", "v_proj", "down_proj"], False),
}


def nonzero_b(state: ft.TrainState, seed: int = 3) -> ft.TrainState:
    """``state`` with random B (zero at init, which would leave A without a gradient)."""
    g = torch.Generator().manual_seed(seed)
    flat = {
        k: torch.randn(v.shape, generator=g) * 0.1 if k.endswith("lora_B") else v.clone()
        for k, v in tree.to_flat(state.params).items()
    }
    return state.replace(params=tree.from_flat(flat))


def peft_copy(model, state, targets, fan_in_fan_out):
    """peft's LoRA on a copy of ``model``, with ``state``'s adapters."""
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, fan_in_fan_out=fan_in_fan_out
    )
    theirs = peft.inject_adapter_in_model(config, copy.deepcopy(model))
    adapters = {}
    for k, v in tree.to_flat(state.params).items():
        path, which = k.rsplit(".", 1)  # peft: <path>.lora_A.default.weight
        adapters[f"{path}.{which}.default.weight"] = v
    result = theirs.load_state_dict(adapters, strict=False)
    assert not result.unexpected_keys
    return theirs


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_and_adapter_grads_equal_peft(name):
    make, make_loss, targets, fan_in_fan_out = MODELS[name]
    model = make()
    lora = ft.lora(model, rank=4, alpha=8, targets=targets)
    assert any(lora.fan_in_fan_out) == fan_in_fan_out
    state = nonzero_b(lora.init_state(ft.params_of(model), ft.optim.sgd(1.0), seed=0))
    theirs = peft_copy(model, state, targets, fan_in_fan_out)
    batch = lm_batch(4)

    out = theirs(batch["input"])
    logits = out.logits if hasattr(out, "logits") else out
    loss = ft.losses.cross_entropy(logits, batch["target"])
    (loss.total / loss.count).backward()

    ours = ft.apply(model, ft.merge_lora(state), batch["input"])
    ours = ours.logits if hasattr(ours, "logits") else ours
    assert (ours - logits).abs().max() <= 1e-5

    step = lora(ft.train_step(make_loss(model), ft.optim.sgd(1.0)))
    new, metrics = step(state, batch)
    assert torch.allclose(metrics["loss"], loss.total / loss.count, atol=1e-6)
    before, after = tree.to_flat(state.params), tree.to_flat(new.params)
    for key in before:  # sgd(1.0): the update is minus the gradient
        path, which = key.rsplit(".", 1)
        grad = theirs.get_submodule(f"{path}.{which}.default").weight.grad
        assert (before[key] - after[key] - grad).abs().max() <= 1e-5, key
    # the base is frozen: the same tensors after the step, and no gradient anywhere else
    base = tree.to_flat(new.extra["lora", "base"])
    assert all(torch.equal(v, base[k]) for k, v in tree.to_flat(ft.params_of(model)).items())


def test_merge_lora_is_the_adapted_model_and_leaves_the_state():
    model = tiny_gpt()
    lora = ft.lora(model, rank=2, alpha=3, targets="all-linear")
    assert len(lora.targets) == 8  # qkv, attn.proj, mlp.fc, mlp.proj in 2 blocks (head tied)
    state = nonzero_b(lora.init_state(ft.params_of(model), ft.optim.sgd(0.1), seed=1))
    copied = state.clone()
    merged = ft.merge_lora(state)
    x = lm_batch(2)["input"]
    adapted = ft.apply(model, lora.merged(state.params, state), x)
    assert torch.allclose(ft.apply(model, merged, x), adapted, atol=1e-6)
    assert tree.paths(merged) == tree.paths(ft.params_of(model))
    assert all(torch.equal(a, b) for a, b in zip(tree.leaves(state), tree.leaves(copied)))
    # B = 0 at init: the adapted model starts as the base
    fresh = lora.init_state(ft.params_of(model), ft.optim.sgd(0.1))
    assert torch.equal(ft.apply(model, ft.merge_lora(fresh), x), model(x))


def test_optimizer_state_holds_only_adapters():
    model = tiny_gpt(d_model=64)
    opt = ft.optim.adamw(1e-3)
    lora = ft.lora(model, rank=4, targets=["attn.qkv", "attn.proj"])
    state = lora.init_state(ft.params_of(model), opt)
    full = ft.TrainState.create(ft.params_of(model), opt)
    moments = {p.rsplit(".", 1)[0] for p in tree.paths(state.opt_state) if "lora_" in p}
    assert moments and all(".lora_" in p for p in tree.paths(state.params))
    assert not [p for p in tree.paths(state.opt_state) if p.endswith("weight")]
    ratio = ft.optim.state_bytes(state.opt_state) / ft.optim.state_bytes(full.opt_state)
    # adapters: 2 blocks x (4 x (64 + 192) + 4 x (64 + 64)) = 3072 numbers of ~103k params
    assert ratio < 0.04, ratio
    new, _ = lora(ft.train_step(lm_loss(model), opt))(state, lm_batch(4))
    assert tree.paths(new.opt_state) == tree.paths(state.opt_state)


def test_under_vmap_equals_each_member_run_alone():
    """ft.vmap of a LoRA step (members with their own adapters, the base stacked in each
    member's state) gives each member exactly what its own LoRA step gives it."""
    model = tiny_gpt()
    opt = ft.optim.adam(1e-2)
    lora = ft.lora(model, rank=2, targets=["attn.qkv", "mlp.fc"])
    alone = [lora.init_state(ft.params_of(model), opt, seed=s) for s in (0, 1)]
    step = lora(ft.train_step(lm_loss(model), opt))
    together = ft.stack(alone)
    vstep = ft.vmap(lora(ft.train_step(lm_loss(model), opt)))
    batch = lm_batch()
    for _ in range(2):
        together, _ = vstep(together, batch)
        alone = [step(s, batch)[0] for s in alone]
    for member, state in zip(ft.unstack(together), alone):
        got, want = tree.to_flat(member.params), tree.to_flat(state.params)
        assert got.keys() == want.keys()
        assert all(torch.allclose(got[k], want[k], rtol=1e-5, atol=1e-6) for k in want)
    assert not torch.equal(alone[0].params["blocks", "0", "attn", "qkv", "lora_B"],
                           alone[1].params["blocks", "0", "attn", "qkv", "lora_B"])  # fmt: skip


@pytest.mark.usefixtures("whole_step_graphs")
def test_the_merge_compiles_with_the_step_as_one_graph():
    model = tiny_gpt(dropout=0.0)
    opt = ft.optim.adamw(1e-2)
    lora = ft.lora(model, rank=2, alpha=4, targets=["qkv", "fc"])
    state = nonzero_b(lora.init_state(ft.params_of(model), opt, seed=0))
    plain = lora(ft.train_step(lm_loss(model), opt))
    assert_one_graph(plain, state, lm_batch(6, lengths=(16, 3, 1, 9, 16, 5)))  # no graph break


def test_composes_with_accumulate_checkpoint_autocast_and_compile():
    model = tiny_gpt(dropout=0.0)
    opt = ft.optim.adamw(1e-2)
    lora = ft.lora(model, rank=2, alpha=4, targets=["qkv", "fc"])
    state = nonzero_b(lora.init_state(ft.params_of(model), opt, seed=0))
    batch = lm_batch(6, lengths=(16, 3, 1, 9, 16, 5))
    plain = lora(ft.train_step(lm_loss(model), opt))
    composed = lora(ft.checkpoint(ft.accumulate(ft.train_step(lm_loss(model), opt), 3)))
    assert_steps_close(composed, plain, state, batch, steps=2, rtol=1e-5)
    # transforms applied after lora act on the same step
    outer = ft.accumulate(lora(ft.train_step(lm_loss(model), opt)), 2)
    assert_steps_close(outer, plain, state, batch, steps=2, rtol=1e-5)
    # bf16 against fp32 under sgd (Adam's first update is about lr * sign(grad): ill-conditioned)
    sgd = ft.optim.sgd(0.5)
    bf16 = lora(ft.autocast(ft.train_step(lm_loss(model), sgd), torch.bfloat16))
    fp32 = lora(ft.train_step(lm_loss(model), sgd))
    start = state.replace(opt_state=sgd.init(state.params))
    assert_steps_close(bf16, fp32, start, batch, steps=1, rtol=2e-2)
    assert_steps_close(
        ft.compile(plain, backend="aot_eager"), plain, state, batch, steps=2, rtol=1e-5
    )
    # activation checkpointing still saves less for backward (the merged weights are saved alike)
    blocks = lora(ft.checkpoint(ft.train_step(lm_loss(model), opt)))
    assert saved_activation_bytes(blocks, state, batch) < saved_activation_bytes(
        plain, state, batch
    )
    with pytest.raises(
        TypeError, match=r"ft\.lora makes the loss function's params .* pass the state"
    ):
        plain.forward(state.params, batch)


def test_errors_name_the_argument_and_the_fix():
    model = tiny_gpt()
    with pytest.raises(ValueError, match=r"'attn\.q' selects no linear layer.*attn\.qkv"):
        ft.lora(model, targets=["attn.q"])
    with pytest.raises(ValueError, match=r"'ln_1' .*not linear layers"):
        ft.lora(model, targets=["ln_1"])
    with pytest.raises(ValueError, match=r"rank=0"):
        ft.lora(model, rank=0, targets=["qkv"])
    gpt2 = ft.models.hf.tiny_gpt2(vocab_size=64, n_positions=16, n_embd=32)
    with pytest.raises(ValueError, match=r"'lm_head' has a weight tied"):
        ft.lora(gpt2, targets=["lm_head"])
    assert "lm_head" not in ft.lora(gpt2, targets="all-linear").targets
    lora = ft.lora(model, targets=["qkv"])
    plain = ft.TrainState.create(ft.params_of(model), ft.optim.sgd(0.1))
    with pytest.raises(ValueError, match=r"init_state"):
        lora(ft.train_step(lm_loss(model), ft.optim.sgd(0.1)))(plain, lm_batch(2))
    with pytest.raises(ValueError, match=r"ft\.merge_lora\(state\)"):
        ft.merge_lora(plain)
    with pytest.raises(ValueError, match=r"expected \(96, 32\)"):
        lora.init_state(ft.params_of(tiny_gpt(d_model=64)), ft.optim.sgd(0.1))


def test_under_every_shard_strategy(two_ranks):
    """2 ranks, each given half the batch, train the adapters as 1 process given all of it; the
    base stays frozen (fsdp shards it in state.extra like the rest)."""
    from _two_ranks import batches, lora_setup, run, sgd

    model, lora, step, state = lora_setup(sgd)
    reference, _ = run(step, state, batches())
    want = tree.to_flat(reference.params)
    for strategy in ("ddp", "zero1", "zero2", "fsdp"):
        for r in two_ranks:
            got = r["lora", strategy]["params"]
            assert got.keys() == want.keys()
            for k in want:
                err = (got[k] - want[k]).abs().max() / want[k].abs().max()
                assert err <= 1e-5, (strategy, k, float(err))


# -- ftrain train --lora-rank ------------------------------------------------------------------------


def _final(path):
    return ft.load(ft.latest_checkpoint(path)).to_tensordict().flatten_keys(".")


def test_a_lora_run_resumes_bit_for_bit(tmp_path, tiny_run):
    """8 steps == 4 steps + --resume to 8 (adapters, optimizer state, data position; the frozen
    base rebuilt); the checkpoint's params are the adapters only, its optimizer state theirs,
    and it holds no base."""
    from ftrain.app.cli import main

    common = [*tiny_run, "--lora-rank", "2", "--lora-alpha", "4", "--lora-targets",
              "attn.qkv,mlp.fc", "--warmup", "2", "--save-every", "4"]  # fmt: skip
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["train", *common, "--max-steps", "8", "--out", str(a)]) == 0
    assert main(["train", *common, "--max-steps", "4", "--decay-steps", "8", "--out", str(b)]) == 0
    assert main(["train", *common, "--max-steps", "8", "--out", str(b), "--resume"]) == 0
    ta, tb = _final(a), _final(b)
    assert sorted(ta.keys()) == sorted(tb.keys())
    for k in ta.keys():
        assert torch.equal(ta[k], tb[k]), k
    params = [k for k in ta.keys() if k.startswith("params.")]
    assert params and all(".lora_" in k for k in params)
    assert not [k for k in ta.keys() if k.startswith("opt_state.") and k.endswith("weight")]
    # the checkpoint leaves the frozen base out: it is the model's (here the seed's) own weights
    assert not [k for k in ta.keys() if ".base." in k] and "extra.lora.scaling" in ta.keys()


def test_the_lora_settings_are_config_file_keys(tmp_path):
    from ftrain.app.config import TrainConfig, load_toml

    path = tmp_path / "lora.toml"
    path.write_text('lora_rank = 4\nlora-alpha = 8\nlora_targets = "attn.qkv,mlp.fc"\n')
    cfg = TrainConfig(**load_toml(path))
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets) == (4, 8.0, "attn.qkv,mlp.fc")
    with pytest.raises(ValueError, match="--lora-rank must be >= 0"):
        TrainConfig(lora_rank=-1).validate()


def test_a_lora_target_that_matches_nothing_is_a_usage_error(tmp_path, tiny_run):
    from ftrain.app.cli import main

    with pytest.raises(SystemExit, match=r"--lora-targets attn\.q: .*selects no linear layer"):
        main(["train", *tiny_run, "--lora-rank", "2", "--lora-targets", "attn.q",
              "--out", str(tmp_path / "r")])  # fmt: skip


def test_split_base_leaves_what_training_changed_and_join_base_restores_it():
    """A LoRA checkpoint's state: no frozen base; joined with the model's params it merges and
    steps as the original; without it, merge_lora and the step say how to put it back."""
    from ftrain.transforms.lora import join_base, split_base

    model = tiny_gpt()
    opt = ft.optim.adamw(1e-2)
    lora = ft.lora(model, rank=2, targets=["attn.qkv", "mlp.fc"])
    step = lora(ft.train_step(lm_loss(model), opt))
    state, _ = step(lora.init_state(ft.params_of(model), opt), lm_batch(4))
    light, base = split_base(state)
    assert "base" not in light.extra["lora"].keys() and "base" in state.extra["lora"].keys()
    assert split_base(light) == (light, None) and join_base(light, None) is light
    joined = join_base(light, ft.params_of(model))
    assert_trees_close(ft.merge_lora(joined), ft.merge_lora(state), tol=0)
    assert_trees_close(step(joined, lm_batch(4, seed=1))[0].params,
                       step(state, lm_batch(4, seed=1))[0].params, tol=0)  # fmt: skip
    with pytest.raises(ValueError, match=r"holds the adapters but not the frozen base.*join_base"):
        ft.merge_lora(light)
    with pytest.raises(ValueError, match="join_base"):
        step(light, lm_batch(4))
