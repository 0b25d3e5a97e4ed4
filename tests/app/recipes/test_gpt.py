"""The built-in recipe (ftrain.app.recipes.gpt): schedule, optimizer, loss, the composed step, the
initial state, sampling."""

import copy
from pathlib import Path

import pytest
import torch

import ftrain as ft
from ftrain import optim
from ftrain.app import model_parallel, recipes
from ftrain.app.cli import main, parser
from ftrain.app.config import TrainConfig, from_args
from ftrain.app.recipes import gpt


def _config(args):
    return from_args(parser().parse_args(["train", *args]))


def test_data_dir(monkeypatch):
    assert gpt.data_dir(TrainConfig(data_dir="here")) == Path("here")
    monkeypatch.setenv("FTRAIN_CACHE", "/cache")
    assert gpt.data_dir(TrainConfig()) == Path("/cache/stdlib")
    monkeypatch.delenv("FTRAIN_CACHE")
    assert gpt.data_dir(TrainConfig()) == Path.home() / ".cache" / "ftrain" / "stdlib"


@pytest.mark.parametrize(
    "name, values",  # lr 1, 10 warmup steps, 100 steps: the lr at steps 0, 5, 10, 55, 80, 90, 100
    [
        ("constant", [0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0]),
        ("cosine", [0.0, 0.5, 1.0, 0.55, None, None, 0.1]),  # to lr / 10, half way at 55
        ("linear", [0.0, 0.5, 1.0, 0.5, None, None, 0.0]),
        ("wsd", [0.0, 0.5, 1.0, 1.0, 1.0, 0.5, 0.0]),  # the last fifth decays
        ("inverse_sqrt", [0.0, 0.5, 1.0, None, None, (10 / 90) ** 0.5, 0.1**0.5]),
    ],
)
def test_schedules(name, values):
    schedule = gpt.build_schedule(TrainConfig(lr=1.0, warmup=10, max_steps=100, lr_schedule=name))
    for step, want in zip((0, 5, 10, 55, 80, 90, 100), values):
        if want is not None:
            assert float(schedule(step)) == pytest.approx(want, abs=1e-6), step
    # --decay-steps fixes the schedule's length, whatever --max-steps a run stops at
    longer = gpt.build_schedule(TrainConfig(lr=1.0, warmup=10, max_steps=200, lr_schedule=name))
    early = gpt.build_schedule(
        TrainConfig(lr=1.0, warmup=10, max_steps=60, decay_steps=200, lr_schedule=name)
    )
    assert [float(early(s)) for s in range(60)] == [float(longer(s)) for s in range(60)]


def test_schedule_annotation_resolves_to_the_one_schedule_type():
    import typing

    assert typing.get_type_hints(gpt.build_schedule)["return"] == optim.schedules.Schedule
    assert optim.Schedule is optim.schedules.Schedule


def test_optimizer_decays_matrices_only_and_clips_first():
    torch.manual_seed(0)
    model = ft.models.GPT(
        ft.models.GPTConfig(seq_len=8, d_model=16, n_layer=1, n_head=2, bias=True)
    )
    params = ft.params_of(model)
    cfg = TrainConfig(lr=0.1, warmup=0, lr_schedule="constant", weight_decay=0.5, clip_grad=1.0)
    opt = gpt.build_optimizer(cfg)
    zero = params.apply(torch.zeros_like)  # no gradient: only the weight decay moves a param
    updates, _ = opt.update(zero, opt.init(params), params)
    new = optim.apply_updates(params, updates)
    for key, p in params.items(include_nested=True, leaves_only=True):
        want = p * (1 - 0.1 * 0.5) if p.ndim >= 2 else p  # decoupled decay: lr x wd x p
        torch.testing.assert_close(new[key], want, msg=str(key))
    # A huge gradient is clipped to norm 1 before Adam normalizes it: Adam's first update is
    # -lr x sign(g) either way, so compare the clipped norm through SGD instead.
    sgd = gpt.build_optimizer(TrainConfig(optimizer="sgd", lr=1.0, warmup=0, clip_grad=1.0,
                                          weight_decay=0.0, lr_schedule="constant"))  # fmt: skip
    big = params.apply(lambda p: torch.full_like(p, 100.0))
    updates, _ = sgd.update(big, sgd.init(params), params)
    norm = torch.linalg.vector_norm(torch.cat([u.flatten() for u in updates.values(True, True)]))
    assert float(norm) == pytest.approx(1.0, rel=1e-5)


def test_loss_is_token_cross_entropy_plus_the_experts_balance_loss():
    torch.manual_seed(0)
    batch = {"input": torch.randint(0, 50, (2, 8)), "target": torch.randint(0, 50, (2, 8))}
    dense = ft.models.GPT(
        ft.models.GPTConfig(vocab_size=50, seq_len=8, d_model=16, n_layer=1, n_head=2)
    )
    with torch.no_grad():
        loss = gpt.make_loss_fn(dense)(ft.params_of(dense), batch)
        want = torch.nn.functional.cross_entropy(
            dense(batch["input"]).flatten(0, 1), batch["target"].flatten()
        )
    assert not loss.aux and float(loss.value) == pytest.approx(float(want), rel=1e-5)
    moe = ft.models.GPT(ft.models.GPTConfig(vocab_size=50, seq_len=8, d_model=16, n_layer=1,
                                            n_head=2, n_experts=4, top_k=1))  # fmt: skip
    params = ft.params_of(moe)
    with torch.no_grad():
        loss = gpt.make_loss_fn(moe)(params, batch)
        logits, aux = ft.apply(moe, params, batch["input"], return_aux=True)
    ce = ft.losses.cross_entropy(logits, batch["target"])
    balance = sum(aux.values())
    assert float(loss.aux["moe_aux_loss"]) == pytest.approx(float(balance))
    torch.testing.assert_close(loss.total, ce.total + balance * ce.count)
    assert float(loss.count) == 16


def test_build_is_a_function_of_the_config(tiny_run):
    """The same settings give the same initial state; the step the settings compose trains it
    (fp16 adds its loss scale to the state, accumulation reads micro_batches x batch_size rows)."""
    cfg = _config([*tiny_run, "--precision", "fp16", "--micro-batches", "2"])
    a, b = gpt.build(cfg, quiet=True), gpt.build(cfg, quiet=True)
    ta, tb = a.state.to_tensordict(), b.state.to_tensordict()
    assert set(ta.keys(True, True)) == set(tb.keys(True, True))
    assert "loss_scale" in a.state.extra.keys()
    for k in ta.keys(True, True):
        assert torch.equal(ta[k], tb[k]), k
    assert "loss_scale" not in gpt.build(_config(tiny_run), quiet=True).state.extra.keys()
    with iter(a.loader) as batches:
        batch = next(batches)
        assert batch["input"].shape == (2 * 4, 32)
        state, metrics = a.step(a.state, batch)
    assert int(state.step) == 1 and float(metrics["count"]) == 2 * 4 * 32


def _build_data_on_this_rank(data_dir: str):
    """gpt.build_data on one rank of two, recording which ranks called build_token_dataset."""
    import ftrain.data

    rank, world = ft.distributed.rank_and_world()
    built, real = [], ftrain.data.build_token_dataset
    ftrain.data.build_token_dataset = lambda *a, **kw: built.append(rank) or real(*a, **kw)
    _, valid = gpt.build_data(TrainConfig(data_dir=data_dir, seq_len=16), rank=rank, world=world,
                              quiet=True)  # fmt: skip

    def broken(*a, **kw):
        raise ValueError("no documents here")

    ftrain.data.build_token_dataset = broken  # rank 0's build fails: no rank may wait for it
    try:
        gpt.build_data(TrainConfig(data_dir=data_dir + "-2", seq_len=16), rank=rank, world=world,
                       quiet=True)  # fmt: skip
        failure = None
    except Exception as e:
        failure = (type(e).__name__, str(e))
    return built, len(valid), valid[0]["input"], failure


def test_data_is_built_by_rank_0_and_opened_by_every_rank(tmp_path):
    """Under torchrun every process builds the recipe at once: only rank 0 writes the token build
    (two writers of one folder race on its files); the others open it once rank 0 has written it,
    and stop with rank 0's error when its build fails."""
    ranks = ft.distributed.run_distributed(_build_data_on_this_rank, 2, str(tmp_path / "tokens"))
    assert [built for built, *_ in ranks] == [[0], []]
    (_, n0, row0, fail0), (_, n1, row1, fail1) = ranks
    assert n0 == n1 > 0 and torch.equal(row0, row1)
    # a failed build on rank 0 stops every rank with its error (none waits for a go-ahead)
    assert fail0 == ("ValueError", "no documents here")
    assert fail1 == (
        "RuntimeError",
        "the token build on rank 0 failed: ValueError: no documents here",
    )


def test_build_model_leaves_the_global_generator_as_it_was():
    cfg = TrainConfig(seq_len=16, d_model=32, n_layer=1, n_head=2, seed=3)
    torch.manual_seed(123)
    model = gpt.build_model(cfg)
    after = torch.rand(4)
    torch.manual_seed(123)
    assert torch.equal(after, torch.rand(4))  # building the model drew nothing from it
    # ...and the model is the one cfg.seed gives, whatever the global generator's state
    torch.manual_seed(cfg.seed)
    ref = ft.models.GPT(
        ft.models.GPTConfig(seq_len=16, d_model=32, n_layer=1, n_head=2, bias=False)
    )
    for (n, a), (m, b) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert n == m and torch.equal(a, b), n


def test_sample_reads_a_checkpoint_whose_settings_this_version_lacks(tmp_path):
    cfg = TrainConfig(seq_len=16, d_model=32, n_layer=1, n_head=2)
    opt = optim.sgd(0.1)
    state = ft.TrainState.create(ft.params_of(gpt.build_model(cfg)), opt)
    settings = {**cfg.to_dict(), "a_setting_of_a_later_version": 1}
    ft.save_checkpoint(tmp_path / "run", state, extra={"config": settings})
    text = recipes.sample(tmp_path / "run", "def ", 6, temperature=0.8, top_k=50)
    assert text == gpt.sample_text(gpt.build_model(cfg), state.params, "def ", 6)


def test_sample_text_follows_the_params_not_the_template():
    torch.manual_seed(0)
    cfg = TrainConfig(seq_len=16, d_model=32, n_layer=1, n_head=2)
    model = gpt.build_model(cfg)
    template = copy.deepcopy(model.state_dict())
    params = ft.params_of(gpt.build_model(TrainConfig(seq_len=16, d_model=32, n_layer=1, n_head=2,
                                                      seed=1)))  # fmt: skip
    text = gpt.sample_text(model, params, "def ", 12, seed=3)
    assert text == gpt.sample_text(model, params, "def ", 12, seed=3)  # the seed fixes it
    # the reference: the model loaded with params, generating from the same generator state
    ref = gpt.build_model(TrainConfig(seq_len=16, d_model=32, n_layer=1, n_head=2, seed=1)).eval()
    ids = torch.tensor([list(b"def ")])
    out = ft.models.generate(ref, ids, 12, temperature=0.8, top_k=50,
                             generator=torch.Generator().manual_seed(3))  # fmt: skip
    assert text == ft.data.ByteTokenizer().decode(out[0].tolist()) and text.startswith("def ")
    for k, v in model.state_dict().items():  # the template is untouched
        assert torch.equal(v, template[k]), k


def test_sample_with_an_empty_prompt_is_unconditional(tmp_path, tiny_run, capsys):
    out = tmp_path / "run"
    args = [*tiny_run, "--max-steps", "1", "--out", str(out)]
    assert main(["train", *args]) == 0
    capsys.readouterr()
    assert main(["sample", "--run", str(out), "--prompt", "", "--max-new-tokens", "20"]) == 0
    assert capsys.readouterr().out.strip("\n")  # some text (the start token is not printed)
    model = ft.models.GPT(ft.models.GPTConfig(seq_len=8, d_model=16, n_layer=1, n_head=2)).eval()
    with pytest.raises(ValueError, match="T >= 1"):
        ft.models.generate(model, torch.zeros(1, 0, dtype=torch.long), 3)


def test_schedule_free_trains_y_and_evaluates_and_samples_at_x(tmp_path, tiny_run, capsys):
    """`--optimizer schedule_free_adamw`: its own warmup from --lr (no decay), checkpoints hold
    the train params y and the state, validation and samples use x = (y - (1 - b1) z) / b1."""
    import json

    from ftrain.app.loop import validation_loss

    out = tmp_path / "run"
    args = [*tiny_run, "--optimizer", "schedule_free_adamw", "--max-steps", "4", "--warmup", "2",
            "--eval-every", "4", "--out", str(out)]  # fmt: skip
    assert main(["train", *args]) == 0
    cfg = _config(args)
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in records if "lr" in r] == pytest.approx([cfg.lr / 2] + [cfg.lr] * 3)
    state = ft.load(ft.latest_checkpoint(out))
    y, z = state.params, state.opt_state["inner_state", "1", "z"]  # "0": the gradient clipping
    x = gpt.eval_params(cfg, state)
    for key, t in x.items(include_nested=True, leaves_only=True):
        torch.testing.assert_close(t, (y[key] - 0.1 * z[key]) / 0.9, msg=str(key))
    recipe = gpt.build(cfg, quiet=True)
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert val == [validation_loss(recipe.model, x, recipe.valid, cfg)]
    assert val[0] != validation_loss(recipe.model, y, recipe.valid, cfg)
    text = recipes.sample(out, "def ", 8, temperature=0.8, top_k=50)
    assert text == gpt.sample_text(recipe.model, x, "def ", 8)
    assert gpt.eval_params(_config(tiny_run), state) is y  # other optimizers: the train params


def test_the_gpt_trains_on_chat_data_packed(tmp_path, tiny_run):
    """--data chats.jsonl --pack with the byte-level GPT: batches carry position ids and -100 on
    the user's turns (the built-in chat template), and the step trains on them."""
    import json

    chat = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong!"}]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"messages": chat}) for _ in range(50)))
    flags = [*tiny_run, "--data", str(tmp_path / "c.jsonl"), "--pack"]
    flags[flags.index("--data-dir") + 1] = str(tmp_path / "tokens")
    recipe = gpt.build(_config(flags), quiet=True)
    with iter(recipe.loader) as batches:
        batch = next(batches)
        state, metrics = recipe.step(recipe.state, batch)
    assert set(batch) == {"input", "target", "position_ids"}
    said = batch["target"][batch["target"] != -100]
    assert 0 < len(said) < batch["target"].numel() // 2
    assert set(bytes(said[said < 256].tolist()).decode()) <= set("pong!<|end>\n")
    assert int(metrics["count"]) == len(said) and torch.isfinite(metrics["loss"])


def _born_and_whole_on_this_rank(cfg):
    from ftrain.distributed import shard_state
    from ftrain.distributed.dtensor import is_dtensor, local

    def mine(t):
        return local(t) if is_dtensor(t) else t

    opt = gpt.build_optimizer(cfg)
    world = torch.distributed.get_world_size()
    mesh = ft.distributed.tp_mesh(cfg.tp) if cfg.tp > 1 else None
    model, born = gpt.build_model_and_state(cfg, opt, world=world, mesh=mesh)
    whole = gpt.build_state(cfg, gpt.build_model(cfg), opt)
    if mesh is None:
        whole = shard_state(whole, "fsdp")
        born = shard_state(born, "fsdp")  # as the loop does: a LoRA run's adapters (no-op else)
    else:  # the loop's way: tensor-parallel pieces, then split over the dp groups
        tp = model_parallel.build_tensor_parallel(cfg, gpt.build_model(cfg), mesh)
        whole = shard_state(tp.shard_state(whole), "fsdp", mesh["dp"])
    same = all(
        type(a) is type(b) and torch.equal(mine(a), mine(b))
        for field in ("params", "opt_state", "extra")
        for a, b in zip(
            ft.tree.leaves(getattr(born, field)), ft.tree.leaves(getattr(whole, field)), strict=True
        )
    )
    return same, all(p.is_meta for p in model.parameters()), int(born.rng) == int(whole.rng)


def test_shard_fsdp_builds_the_state_born_sharded():
    """Under --shard fsdp over 2 processes the recipe's state is born as each process's shards
    (the template on meta), bitwise the whole state laid out by shard_state; elsewhere whole."""
    cfg = _config(["--shard", "fsdp", "--seq-len", "16", "--d-model", "32", "--n-layer", "2",
                   "--n-head", "2", "--seed", "5", "--device", "cpu"])  # fmt: skip
    assert gpt.born_sharded(cfg, 2) and not gpt.born_sharded(cfg, 1)
    assert not gpt.born_sharded(_config(["--shard", "zero2"]), 2)
    ranks = ft.distributed.run_distributed(_born_and_whole_on_this_rank, 2, cfg)
    assert ranks == [(True, True, True)] * 2


def test_lora_with_shard_fsdp_builds_its_frozen_base_born_sharded():
    """--lora-rank with --shard fsdp over 2 processes: the frozen base (state.extra["lora"]) born
    as each process's rows; once the loop has sharded the adapters, bitwise the whole way."""
    cfg = _config(["--shard", "fsdp", "--lora-rank", "2", "--seq-len", "16", "--d-model", "32",
                   "--n-layer", "2", "--n-head", "2", "--seed", "5", "--device", "cpu"])  # fmt: skip
    assert gpt.born_sharded(cfg, 2)
    ranks = ft.distributed.run_distributed(_born_and_whole_on_this_rank, 2, cfg)
    assert ranks == [(True, True, True)] * 2


def test_tp_with_shard_fsdp_builds_the_state_born_laid_out():
    """--tp 2 --shard fsdp over 4 processes: born as each process's tensor-parallel pieces split
    over the dp groups, bitwise the whole state laid out as the loop lays it out."""
    cfg = _config(["--tp", "2", "--shard", "fsdp", "--seq-len", "16", "--d-model", "32",
                   "--n-layer", "2", "--n-head", "2", "--seed", "5", "--device", "cpu"])  # fmt: skip
    assert gpt.born_sharded(cfg, 4)
    ranks = ft.distributed.run_distributed(_born_and_whole_on_this_rank, 4, cfg)
    assert ranks == [(True, True, True)] * 4
