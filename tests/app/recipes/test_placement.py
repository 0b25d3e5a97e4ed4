"""Where ``ftrain train`` runs (ftrain.app.recipes.placement): ``--device`` and ``--precision auto``
resolved (CUDA faked where a GPU is needed), the recipe's model, state and batches on the chosen
device, and checkpoints that move between GPU and CPU machines. Tests that need a real GPU skip
without one."""

import json

import pytest
import safetensors.torch
import torch

import ftrain as ft
from ftrain.app.cli import main
from ftrain.app.config import TrainConfig
from ftrain.app.loop import validation_loss
from ftrain.app.recipes import gpt, placement
from ftrain.io import meta_checksum
from ftrain.transforms import Autocast

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def fake_gpus(monkeypatch):
    """A machine that shows ``n`` CUDA GPUs of compute capability ``cap`` to the resolution
    code (nothing is run on them): ``fake_gpus(2, (9, 0))``."""

    def fake(n: int, cap: tuple[int, int] = (9, 0)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
        monkeypatch.setattr(torch.version, "hip", None)

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return fake


# -- resolution ---------------------------------------------------------------------------------
def test_auto_is_the_cpu_without_cuda_and_the_first_gpu_with_it(fake_gpus):
    fake_gpus(0)
    assert placement.resolve_device("auto") == torch.device("cpu")
    assert placement.resolve_device("cpu") == torch.device("cpu")
    fake_gpus(2)
    assert placement.resolve_device("auto") == torch.device("cuda", 0)
    assert placement.resolve_device("cuda") == torch.device("cuda", 0)
    assert placement.resolve_device("cuda:1") == torch.device("cuda", 1)
    assert placement.resolve_device("cpu") == torch.device("cpu")


def test_under_torchrun_each_process_takes_its_local_rank_gpu(fake_gpus, monkeypatch):
    fake_gpus(4)
    monkeypatch.setenv("WORLD_SIZE", "8")  # two nodes of 4
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert placement.resolve_device("auto") == torch.device("cuda", 3)
    assert placement.resolve_device("cuda") == torch.device("cuda", 3)
    with pytest.raises(ValueError, match=r"^--device cuda:1: under torchrun each process takes"):
        placement.resolve_device("cuda:1")
    monkeypatch.setenv("LOCAL_RANK", "4")
    with pytest.raises(ValueError, match=r"LOCAL_RANK 4 asked for, but this machine shows 4 GPU"):
        placement.resolve_device("auto")


@pytest.mark.parametrize(
    "gpus, spec, message",
    [
        (0, "cuda", "--device cuda: CUDA is not available on this machine"),
        (0, "cuda:0", "--device cuda:0: CUDA is not available on this machine"),
        (2, "cuda:2", "--device cuda:2: GPU 2 asked for, but this machine shows 2 GPU(s)"),
        (2, "tpu", "--device tpu: not a device ftrain trains on; pass auto, cpu, cuda or cuda:N"),
        (2, "cuda:x", "--device cuda:x: not a device ftrain trains on"),
    ],
)
def test_a_device_that_is_not_here_is_one_line_naming_it(fake_gpus, gpus, spec, message):
    fake_gpus(gpus)
    with pytest.raises(ValueError) as e:
        placement.resolve_device(spec)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_cuda_on_a_cpu_machine_is_a_usage_error_before_any_data_build(fake_gpus, tmp_path, capsys):
    fake_gpus(0)
    tokens = tmp_path / "tokens"
    with pytest.raises(SystemExit) as e:
        main(["train", "--device", "cuda", "--data-dir", str(tokens), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert err.splitlines()[-1].startswith("ftrain train: error: --device cuda: CUDA is not")
    assert not tokens.exists() and not (tmp_path / "r").exists()


def test_memory_budget_auto_reads_a_gpu_so_a_cpu_run_is_refused(fake_gpus, capsys):
    fake_gpus(2)  # a GPU machine, but the run asks for the CPU
    with pytest.raises(SystemExit) as e:
        main(["train", "--device", "cpu", "--memory-budget", "auto"])
    assert e.value.code == 2
    assert "--memory-budget auto reads the free memory of the GPU" in capsys.readouterr().err


@pytest.mark.parametrize(
    "gpus, cap, precision, want",
    [
        (0, (9, 0), "auto", "fp32"),  # the CPU
        (1, (9, 0), "auto", "bf16"),  # Hopper
        (1, (8, 0), "auto", "bf16"),  # Ampere
        (1, (7, 0), "auto", "fp32"),  # Volta: bf16 only emulated
        (1, (9, 0), "fp16", "fp16"),  # an explicit choice stays
        (0, (9, 0), "bf16", "bf16"),
    ],
)
def test_precision_auto_is_bf16_where_the_gpu_has_it(fake_gpus, gpus, cap, precision, want):
    fake_gpus(gpus, cap)
    cfg = placement.resolve(TrainConfig(precision=precision))
    assert cfg.precision == want
    assert placement.resolve(cfg) == cfg  # idempotent: a resolved config stays as it is


def _autocasts(cfg):
    model = gpt.build_model(cfg)
    step = gpt.build_step(cfg, model, gpt.build_optimizer(cfg))
    return [(t.dtype, t.tf32) for t in step.transforms if isinstance(t, Autocast)]


def test_the_step_gets_tf32_on_a_gpu_that_has_it_and_nothing_on_the_cpu(fake_gpus):
    """The composition built for a (faked) GPU: bf16 autocast by default, TF32 for fp32 work on
    Ampere and newer unless --no-tf32; on the CPU, fp32 adds no transform at all."""
    small = dict(d_model=32, n_layer=1, n_head=2, seq_len=16)
    fake_gpus(0)
    assert _autocasts(TrainConfig(**small)) == []
    fake_gpus(1, (9, 0))
    assert _autocasts(TrainConfig(**small)) == [(torch.bfloat16, True)]
    assert _autocasts(TrainConfig(**small, precision="fp32")) == [(torch.float32, True)]
    assert _autocasts(TrainConfig(**small, precision="fp32", tf32=False)) == []
    fake_gpus(1, (7, 0))  # no TF32 before Ampere
    assert _autocasts(TrainConfig(**small, precision="fp32")) == []


def test_no_loss_fp32_computes_the_log_probabilities_in_the_forward_precision():
    """--no-loss-fp32 under bf16: the recipe's loss is cross_entropy(fp32=False) of the bf16
    logits (not the default's fp32 one), and the run's first line says so."""
    small = dict(d_model=32, n_layer=1, n_head=2, seq_len=16, device="cpu", precision="bf16")
    batch = {"input": torch.randint(0, 257, (4, 16)), "target": torch.randint(0, 257, (4, 16))}
    losses = {}
    for fp32 in (True, False):
        cfg = placement.resolve(TrainConfig(**small, loss_fp32=fp32))
        torch.manual_seed(0)
        model = gpt.build_model(cfg)
        params = ft.params_of(model)
        with torch.autocast("cpu", torch.bfloat16):
            logits = ft.apply(model, params, batch["input"])
        want = ft.losses.cross_entropy(logits, batch["target"], fp32=fp32)
        step = gpt.build_step(cfg, model, gpt.build_optimizer(cfg))
        _, metrics = step(ft.TrainState.create(params, gpt.build_optimizer(cfg)), batch)
        assert torch.equal(metrics["loss"], want.total / want.count)
        losses[fp32] = metrics["loss"]
        assert f"bf16 autocast, loss {'fp32' if fp32 else 'bf16'};" in placement.describe(cfg)
    assert not torch.equal(losses[True], losses[False])  # bf16 log-probabilities round


def test_sdpa_backend_on_the_cpu_and_the_first_line_of_a_cpu_run():
    assert (
        placement.sdpa_backend(torch.device("cpu"), torch.float32, 64, dropout=0.0, masked=False)
        == "CPU"
    )
    line = placement.describe(placement.resolve(TrainConfig(device="cpu")))
    assert line.startswith("ftrain train: device cpu (") and "; precision fp32; " in line
    assert "attention SDPA CPU" in line and "optimizer adamw " in line and "TF32" not in line


# -- placement ----------------------------------------------------------------------------------
def test_model_state_and_batches_go_to_the_resolved_device(monkeypatch, tmp_path):
    """The recipe puts everything on cfg.device. ``meta`` stands in for a GPU here (a device that
    is not the CPU and holds no data): every param, optimizer tensor and batch must land on it."""
    monkeypatch.setattr(placement, "resolve_device", torch.device)
    cfg = TrainConfig(device="meta", d_model=32, n_layer=1, n_head=2, seq_len=16, batch_size=2,
                      data_dir=str(tmp_path / "tokens"))  # fmt: skip
    recipe = gpt.build(cfg, quiet=True)
    assert {t.device.type for t in ft.tree.leaves(recipe.state.params)} == {"meta"}
    # the optimizer's tensors too; its 0-d counters and hyper-parameters are host scalars, as
    # torch's own optimizers keep them (a 0-d CPU tensor mixes with GPU ones without a copy)
    moments = [t for t in ft.tree.leaves(recipe.state.opt_state) if t.dim() > 0]
    assert moments and {t.device.type for t in moments} == {"meta"}
    assert recipe.state.step.device.type == "cpu"  # read by the host without waiting
    with iter(recipe.loader) as batches:
        batch = next(batches)
    assert {t.device.type for t in batch.values()} == {"meta"}


def test_the_template_holds_no_param_values_once_the_state_does():
    """release_params: the template's params become meta tensors (the same Parameter objects, so
    a tied pair stays one), and ft.apply and sampling with the state's params give what they gave
    before, bit for bit: the device holds the params once."""
    cfg = TrainConfig(device="cpu", d_model=32, n_layer=1, n_head=2, seq_len=16)
    model = gpt.build_model(cfg)
    params = ft.params_of(model)
    ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = ft.apply(model, params, ids)
    text = gpt.sample_text(model, params, "def ", 12, seed=3)
    shared = torch.nn.Linear(4, 4)
    tied = torch.nn.Sequential(shared, torch.nn.ReLU(), shared)
    before = [id(p) for p in [*model.parameters(), *tied.parameters()]]
    placement.release_params(model), placement.release_params(tied)
    after = [*model.parameters(), *tied.parameters()]
    assert [id(p) for p in after] == before and {p.device.type for p in after} == {"meta"}
    assert tied[0].weight is tied[2].weight
    assert torch.equal(ft.apply(model, params, ids), logits)
    assert gpt.sample_text(model, params, "def ", 12, seed=3) == text


def test_a_cpu_run_records_what_auto_resolved_to(tmp_path, tiny_run, capsys, fake_gpus):
    fake_gpus(0)
    out = tmp_path / "run"
    assert main(["train", *tiny_run, "--max-steps", "2", "--out", str(out)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("ftrain train: device cpu (") and "precision fp32" in first
    saved = json.loads((out / "config.json").read_text())
    assert (saved["device"], saved["precision"], saved["tf32"]) == ("cpu", "fp32", True)


# -- checkpoints across devices -----------------------------------------------------------------
def _as_if_trained_on_a_gpu(checkpoint):
    """Rewrite the checkpoint's recorded settings as a GPU run's (device cuda:0, bf16), keeping
    its checksum valid: what a run on a GPU machine leaves for a CPU machine to read."""
    path = checkpoint / "meta.json"
    meta = json.loads(path.read_text())
    meta["extra"]["config"].update(device="cuda:0", precision="bf16")
    meta["meta_sha256"] = meta_checksum(meta)
    path.write_text(json.dumps(meta, indent=2))


def test_a_gpu_runs_checkpoint_resumes_samples_and_loads_on_a_cpu_machine(
    tmp_path, tiny_run, capsys, fake_gpus
):
    """A checkpoint whose settings say cuda:0/bf16: it loads with every tensor on the CPU,
    ``ftrain sample`` and ``ftrain consolidate`` read it, and --resume continues on the CPU (noting the change) exactly as
    the same checkpoint with CPU settings does."""
    fake_gpus(0)
    args = [*tiny_run, "--save-every", "2", "--precision", "fp32"]
    gpu, cpu = tmp_path / "gpu", tmp_path / "cpu"
    for out in (gpu, cpu):
        assert main(["train", *args, "--max-steps", "2", "--out", str(out)]) == 0
    _as_if_trained_on_a_gpu(ft.latest_checkpoint(gpu))
    state = ft.load(ft.latest_checkpoint(gpu))
    assert {t.device.type for t in ft.tree.leaves(state.to_tensordict())} == {"cpu"}
    capsys.readouterr()
    assert main(["sample", "--run", str(gpu), "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("def ")
    assert main(["consolidate", "--run", str(gpu), "--out", str(tmp_path / "whole")]) == 0
    whole = safetensors.torch.load_file(tmp_path / "whole" / "model.safetensors")
    assert all(torch.equal(whole[k], t) for k, t in ft.state_dict_of(state.params).items())
    for out in (gpu, cpu):
        assert main(["train", *args, "--max-steps", "4", "--out", str(out), "--resume"]) == 0
    err = capsys.readouterr().err
    note = next(line for line in err.splitlines() if "--resume on this machine" in line)
    assert "--device 'cuda:0' -> 'cpu'" in note and "--precision 'bf16' -> 'fp32'" in note
    a = ft.load(ft.latest_checkpoint(gpu)).to_tensordict().flatten_keys(".")
    b = ft.load(ft.latest_checkpoint(cpu)).to_tensordict().flatten_keys(".")
    assert int(a["step"]) == 4 and sorted(a.keys()) == sorted(b.keys())
    for k in a.keys():
        assert torch.equal(a[k], b[k]), k


@needs_cuda
def test_cuda_state_saves_loads_on_the_cpu_and_back_bitwise(tmp_path):
    model = torch.nn.Linear(8, 4)
    state = ft.TrainState.create(ft.params_of(model), ft.optim.adamw(1e-3)).to_device("cuda")
    ft.save(state, tmp_path / "c")
    on_cpu = ft.load(tmp_path / "c")
    back = ft.load(tmp_path / "c", like=state)
    for k, t in state.params.items(include_nested=True, leaves_only=True):
        assert on_cpu.params[k].device.type == "cpu" and back.params[k].is_cuda
        assert torch.equal(on_cpu.params[k], t.cpu()) and torch.equal(back.params[k], t)


@needs_cuda
def test_a_gpu_run_resumes_on_the_cpu(tmp_path, tiny_run, capsys):
    out = tmp_path / "run"
    assert (
        main(["train", *tiny_run, "--max-steps", "2", "--save-every", "2", "--out", str(out)]) == 0
    )
    saved = json.loads((out / "config.json").read_text())
    assert saved["device"] == "cuda:0"
    assert main(["train", *tiny_run, "--max-steps", "4", "--device", "cpu", "--out", str(out),
                 "--resume", "--precision", saved["precision"]]) == 0  # fmt: skip
    assert int(ft.load(ft.latest_checkpoint(out)).step) == 4


@needs_cuda
def test_the_recipe_on_a_gpu_puts_state_batches_and_evaluation_there(tmp_path):
    cfg = placement.resolve(TrainConfig(d_model=32, n_layer=1, n_head=2, seq_len=16, batch_size=2,
                                        data_dir=str(tmp_path / "tokens"), eval_batches=1))  # fmt: skip
    assert cfg.device == "cuda:0" and placement.describe(cfg).startswith(
        "ftrain train: device cuda:0 ("
    )
    recipe = gpt.build(cfg, quiet=True)
    assert {t.device.type for t in ft.tree.leaves(recipe.state.params)} == {"cuda"}
    with iter(recipe.loader) as batches:
        batch = next(batches)
    assert all(t.is_cuda for t in batch.values())
    state, metrics = recipe.step(recipe.state, batch)
    assert metrics["loss"].is_cuda and torch.isfinite(metrics["loss"])
    assert validation_loss(recipe.model, state.params, recipe.valid, cfg) > 0
    assert gpt.sample_text(recipe.model, state.params, "def ", 4).startswith("def ")
