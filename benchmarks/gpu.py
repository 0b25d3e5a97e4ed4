"""ftrain on a GPU, in one run: every transform checked against its reference on the device, then
GPT-2 124M trained by ftrain beside the imperative PyTorch loop of nanoGPT's bench.py.

    python benchmarks/gpu.py                         # a CUDA machine: about 5 min on an H100;
                                                     # writes the "GPU" section of RESULTS.md
    python benchmarks/gpu.py --device cpu --tiny     # dry run: tiny sizes, writes nothing
    python benchmarks/gpu.py --device cpu --tiny --no-compile --results /tmp/R.md

Needs torch (2.11 or newer), tensordict and torchdata, plus ftrain's own small dependencies
(einops, safetensors, numpy, tqdm). Only two things are compiled (ftrain's step and the
imperative forward/loss of the bench), so compile time stays a minute or two.

Checks (each against a reference computed another way, on the device):
  * ``ft.accumulate(step, 4)`` against the whole batch (fp32, 3 AdamW steps, the suite's bound);
  * ``ft.checkpoint`` blocks / selective against the plain step (max diff; peak memory);
  * bf16 / fp16 ``ft.autocast`` against fp32 (loss to 1e-2; fp16 applies no non-finite update);
  * ``ft.compile``: the bench's compiled step, no recompile across steps (ftrain.testing), its
    first loss against the eager step's;
  * ``ft.shard`` ddp / zero2 / fsdp over NCCL (gloo on the CPU), one process per GPU present:
    N ranks on 1/N of the batch against one process on the whole batch; ddp and zero2 reducing
    in small buckets during backward, alone and with ``ft.offload``'s host copies after them,
    against the reduction after backward;
  * ``ft.offload`` (both modes) against the step on the device, one AdamW step (1e-6), the
    state on the host, the device peak with and without;
  * ``ft.save`` on the device -> ``ft.load`` on the CPU -> ``ft.load(like=)`` back, bitwise;
  * ``ft.memory(...).peak`` against ``torch.cuda.max_memory_allocated`` (on the CPU: live bytes),
    ``ft.offload`` included (the device's peak: its host bytes are not the allocator's);
  * ``ft.data.loader(device=...)`` delivers batches on the device, equal to the CPU loader's.

Bench (nanoGPT bench.py's setting: 12 layers, 768 wide, block 1024, vocab 50304, batch 12, bf16
autocast, AdamW): ms/iter, tokens/s, MFU against the bf16 matmul peak measured here, peak
memory, eager and compiled (eager sides timed in two rounds, the second in reverse order); the
AdamW update alone (ft.optim.adamw vs torch's fused and foreach); and a torch.profiler kernel
table (top 15 by device time) of each eager step, made after every side is timed (a process the
profiler has run in launches kernels more slowly).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import ftrain as ft
from ftrain import optim, testing
from ftrain.app.recipes.placement import release_params
from ftrain.models import GPT, GPTConfig, flops_per_token

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, machine, write_section  # noqa: E402

# nanoGPT bench.py: GPT-2 124M, batch 12 x 1024 tokens, AdamW(lr 6e-4, betas 0.9/0.95, wd 0.1)
BENCH = dict(vocab_size=50304, seq_len=1024, d_model=768, n_layer=12, n_head=12, bias=False)
BENCH_TINY = dict(vocab_size=512, seq_len=64, d_model=64, n_layer=2, n_head=2, bias=False)
CHECK = dict(vocab_size=257, seq_len=256, d_model=256, n_layer=4, n_head=4)
CHECK_TINY = dict(vocab_size=257, seq_len=32, d_model=32, n_layer=2, n_head=2)
PLAN = dict(vocab_size=257, seq_len=512, d_model=512, n_layer=8, n_head=8)  # issue 26's planner run
ADAMW = dict(b1=0.9, b2=0.95, weight_decay=0.1)


@dataclasses.dataclass
class Run:
    device: torch.device
    tiny: bool
    compile: bool
    rows: list = dataclasses.field(default_factory=list)  # check table rows
    dump: Path | None = None  # where the profiler's whole kernel tables go (--dump DIR)
    apart: bool = False  # also the compiled step with the backward apart (--apart)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def check(self, name: str, measured: str, bound: str, ok: bool) -> None:
        self.rows.append(f"| {name} | {measured} | {bound} | {'pass' if ok else '**FAIL**'} |")
        print(f"  {'ok  ' if ok else 'FAIL'} {name}: {measured} (bound {bound})", flush=True)


# -- small pieces ---------------------------------------------------------------------------------
def gpt_task(run: Run, dims: dict, rows: int, *, donate=False, opt=None, seed=0):
    """A GPT on the device, its loss, a fresh optimizer state (default AdamW) and a fixed random
    batch."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**dims)).to(run.device)

    def loss_fn(params, batch):
        return ft.losses.cross_entropy(ft.apply(model, params, batch["input"]), batch["target"])

    opt = opt or optim.adamw(1e-3, **ADAMW, mask=optim.decay_mask)
    step = ft.train_step(loss_fn, opt, donate=donate)
    state = ft.TrainState.create(ft.params_of(model), opt)
    release_params(model)  # as the recipes do: the state holds the params, once
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randint(0, dims["vocab_size"], (rows, dims["seq_len"] + 1), generator=g)
    batch = {
        "input": x[:, :-1].contiguous().to(run.device),
        "target": x[:, 1:].contiguous().to(run.device),
    }
    return model, loss_fn, opt, step, state, batch


def max_diff(a, b) -> float:
    """Largest absolute difference between two TensorDicts of the same keys."""
    return max((x - b[k]).abs().max().item() for k, x in a.items(True, True))


def peak_bytes(run: Run, fn) -> int:
    """Bytes above what was allocated before ``fn()`` at its peak (CUDA allocator's count)."""
    if run.device.type != "cuda":
        fn()
        return 0
    run.sync()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    run.sync()
    return torch.cuda.max_memory_allocated() - base


# -- checks ---------------------------------------------------------------------------------------
def check_transforms(run: Run) -> None:
    dims = CHECK_TINY if run.tiny else CHECK
    rows = 4 if run.tiny else 8
    # accumulate: DESIGN's bound (1e-5 relative), with SGD + momentum as the suite checks it
    # (tests/transforms/test_accumulate.py): Adam's division by sqrt(v) would amplify the fp32
    # rounding of a different summation order on near-zero gradients
    sgd = optim.sgd(0.1, momentum=0.9)
    _, _, _, step, state, batch = gpt_task(run, dims, rows, opt=sgd)
    try:
        testing.assert_steps_close(step, ft.accumulate(step, 4), state, batch, steps=3, rtol=1e-5,
                                   atol=1e-6)  # fmt: skip
        ok, what = True, "within"
    except AssertionError as e:
        ok, what = False, " ".join(str(e).split())[:160]
    run.check("accumulate(4) vs whole batch, fp32, 3 SGD-momentum steps", what,
              "rtol 1e-5, atol 1e-6", ok)  # fmt: skip
    _, _, _, step, state, batch = gpt_task(run, dims, rows)
    # checkpoint: the same loss and grads (the same update), fewer bytes held
    plain_out = {}
    peak = peak_bytes(run, lambda: plain_out.setdefault("s", step(state, batch)))
    for policy in ("blocks", "selective"):
        out = {}
        checkpointed = ft.checkpoint(step, policy)
        p = peak_bytes(run, lambda s=checkpointed, o=out: o.setdefault("s", s(state, batch)))
        d = max_diff(plain_out["s"][0].params, out["s"][0].params)
        mib = f"; peak {p / 2**20:.0f} vs {peak / 2**20:.0f} MiB plain" if peak else ""
        run.check(f"checkpoint {policy} vs plain", f"max abs diff of params {d:.1e}{mib}", "1e-6",
                  d <= 1e-6)  # fmt: skip
    # autocast: bf16 and fp16 losses near fp32's; fp16 skips nothing on a sane model
    ref = float(plain_out["s"][1]["loss"])
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        cast = ft.autocast(step, dtype)
        st, m = cast(cast.init_extra(state), batch)
        rel = abs(float(m["loss"]) - ref) / abs(ref)
        skipped = bool(m["skipped"]) if "skipped" in m else False
        finite = all(bool(torch.isfinite(t).all()) for t in st.params.values(True, True))
        run.check(f"autocast {name} vs fp32 loss", f"rel {rel:.1e}" + (", skipped" if skipped else ""),
                  "1e-2, finite, not skipped", rel <= 1e-2 and finite and not skipped)  # fmt: skip


def check_offload(run: Run) -> None:
    """ft.offload: one AdamW step with the state on the host against the same step on the device
    (different kernels: torch's fused CPU AdamW against its CUDA one), and the device peak."""
    dims = CHECK_TINY if run.tiny else CHECK
    _, _, _, step, state, batch = gpt_task(run, dims, 4 if run.tiny else 8)
    out = {}
    peak = peak_bytes(run, lambda: out.setdefault("plain", step(state, batch)))
    for mode in ("optimizer", "optimizer+gradients"):
        off = ft.offload(step, mode)
        start = off.init_extra(state)  # the optimizer state copied to (pinned) host memory
        p = peak_bytes(run, lambda o=off, s=start, m=mode: out.setdefault(m, o(s, batch)))
        got = out[mode][0]
        d = max_diff(out["plain"][0].params, got.params)
        host = all(t.device.type == "cpu" for t in got.opt_state.values(True, True))
        mib = f"; device peak {p / 2**20:.0f} vs {peak / 2**20:.0f} MiB" if peak else ""
        run.check(f"offload {mode} vs on the device, 1 AdamW step",
                  f"max abs diff of params {d:.1e}, state on the host: {host}{mib}",
                  "1e-6, on the host", d <= 1e-6 and host)  # fmt: skip


def check_save_load(run: Run) -> None:
    _, _, _, _, state, _ = gpt_task(run, CHECK_TINY, 2)
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        handle = ft.save(state, Path(tmp) / "c", blocking=False)
        returned = time.perf_counter() - t
        handle.wait()
        done = time.perf_counter() - t
        on_cpu = ft.load(Path(tmp) / "c")
        back = ft.load(Path(tmp) / "c", like=state)
    same = all(torch.equal(on_cpu.params[k], v.cpu()) and torch.equal(back.params[k], v)
               and back.params[k].device == v.device and on_cpu.params[k].device.type == "cpu"
               for k, v in state.params.items(True, True))  # fmt: skip
    run.check(f"save on {run.device.type} -> load on cpu -> load back (like=)",
              f"bitwise; save returned in {returned * 1e3:.0f} ms, done in {done * 1e3:.0f} ms",
              "bitwise", same)  # fmt: skip


def check_memory_plan(run: Run) -> None:
    """ft.memory's prediction against the allocator's peak (CUDA) or live bytes (CPU)."""
    dims = CHECK_TINY if run.tiny else PLAN
    rows = 4 if run.tiny else 16
    compositions = {
        "fp32": lambda s: s,
        "bf16": lambda s: ft.autocast(s, torch.bfloat16),
        "bf16 + blocks": lambda s: ft.checkpoint(ft.autocast(s, torch.bfloat16), "blocks"),
        "accumulate(4)": lambda s: ft.accumulate(s, 4),
        "accumulate(4) + selective + bf16": lambda s: ft.accumulate(
            ft.checkpoint(ft.autocast(s, torch.bfloat16), "selective"), 4),
        # the device's peak alone: the optimizer state on the host (not in max_memory_allocated)
        "offload optimizer": lambda s: ft.offload(s),
    }  # fmt: skip
    for name, compose in compositions.items():
        if run.device.type == "cuda":
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
        _, _, _, step, state, batch = gpt_task(run, dims, rows, donate=True)
        step = compose(step)
        state = step.init_extra(state)
        predicted = ft.memory(step, state, batch).peak
        if run.device.type == "cuda":
            run.sync()
            torch.cuda.reset_peak_memory_stats()
            out = step(state, batch)
            run.sync()
            measured = torch.cuda.max_memory_allocated() - base
            del out
        else:
            measured = testing.peak_bytes(step, state, batch)
        ratio = predicted / measured
        run.check(f"ft.memory peak, {name}", f"{predicted / 2**20:.1f} / {measured / 2**20:.1f} MiB = {ratio:.3f}",
                  "0.90 to 1.10", 0.9 <= ratio <= 1.1)  # fmt: skip
        del step, state, batch


def check_loader(run: Run) -> None:
    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            return {"input": torch.arange(i, i + 8), "target": torch.full((8,), i)}

    ref = list(ft.data.loader(Rows(), 8, seed=0))
    got = list(ft.data.loader(Rows(), 8, seed=0, device=run.device, num_workers=2))
    ok = all(v.device.type == run.device.type for b in got for v in b.values()) and all(
        torch.equal(a[k], b[k].cpu()) for a, b in zip(ref, got) for k in a
    )
    run.check(f"data.loader(device={run.device.type!r})", f"{len(got)} batches on {run.device.type}",
              "same batches, on the device", ok and len(got) == len(ref))  # fmt: skip


# -- shard over NCCL: one process per GPU -----------------------------------------------------------
BUCKET_MB = 0.05  # several buckets for the check models' gradients


def _shard_rank(rank: int, world: int, store: str, device_type: str, tiny: bool, out: str) -> None:
    import torch.distributed as dist

    backend = "nccl" if device_type == "cuda" else "gloo"  # what ftrain train takes
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    run = Run(torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu"),
              tiny, False)  # fmt: skip
    _, _, _, step, state, batch = gpt_task(run, CHECK_TINY if tiny else CHECK, 4 * world)
    want, _ = step(state, batch)  # one process, the whole batch
    mine = {k: v.chunk(world)[rank] for k, v in batch.items()}
    lines = []
    for strategy in ("ddp", "zero2", "fsdp"):
        got, _ = ft.shard(step, strategy)(ft.shard_state(state, strategy), mine)
        d = max_diff(want.params, ft.unshard_state(got).params)
        lines.append(f"{strategy} {d:.3e}")
    # ddp and zero2 reducing in buckets during backward (small buckets: several per step), alone
    # and with ft.offload's host copies chained after them, against one reduction after backward;
    # offload's on a group that reduces host tensors too (NCCL for the device's, gloo for the
    # host's: its update reduces its shards' norms), as ftrain train --offload makes it
    mixed = None
    if device_type == "cuda":
        from torch.distributed.device_mesh import DeviceMesh

        group = dist.new_group(list(range(world)), backend="cpu:gloo,cuda:nccl")
        mixed = DeviceMesh.from_group(group, "cuda")
    for strategy in ("ddp", "zero2"):
        flat, _ = ft.shard(step, strategy, bucket_mb=None)(ft.shard_state(state, strategy), mine)
        for name, inner, mesh in (
            ("buckets", step, None),
            ("buckets+offload", ft.offload(step, "optimizer+gradients"), mixed),
        ):
            bucketed = ft.shard(inner, strategy, mesh=mesh, bucket_mb=BUCKET_MB)
            start = bucketed.init_extra(ft.shard_state(state, strategy, mesh=mesh))
            got, _ = bucketed(start, mine)
            d = max_diff(ft.unshard_state(flat).params, ft.unshard_state(got).params)
            lines.append(f"{strategy}:{name} {d:.3e}")
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text("\n".join(lines))


def check_shard(run: Run) -> None:
    import torch.multiprocessing as mp

    world = torch.cuda.device_count() if run.device.type == "cuda" else 2  # the CPU: 2 gloo ranks
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out")
        args = (world, os.path.join(tmp, "store"), run.device.type, run.tiny, out)
        procs = [ctx.Process(target=_shard_rank, args=(r, *args)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        codes = [p.exitcode for p in procs]
        if not os.path.exists(out):
            raise RuntimeError(f"the shard ranks wrote no result (exit codes {codes})")
        results = Path(out).read_text().splitlines()
    if any(codes):  # rank 0 checked the states; a rank died after that, in torch's teardown
        print(f"  note: shard ranks exited with codes {codes} after rank 0 wrote its results "
              "(seen once in CI: a C++ thread aborting at interpreter exit)", flush=True)  # fmt: skip
    backend = "NCCL" if run.device.type == "cuda" else "gloo"
    for line in results:
        strategy, d = line.split()
        if ":" in strategy:  # buckets against the same strategy reducing after backward
            strategy, how = strategy.split(":")
            group = "NCCL beside gloo" if "offload" in how and backend == "NCCL" else backend
            run.check(f"shard {strategy} over {group}, {how} of {BUCKET_MB} MiB vs after backward",
                      f"max abs diff of params {float(d):.1e}", "1e-6", float(d) <= 1e-6)  # fmt: skip
            continue
        run.check(f"shard {strategy} over {backend}, {world} process(es) vs 1 on the whole batch",
                  f"max abs diff of params {float(d):.1e}", "1e-5", float(d) <= 1e-5)  # fmt: skip


# -- the GPT-2 124M bench ---------------------------------------------------------------------------
def matmul_peak(run: Run) -> float:
    """The best bf16 matmul FLOP/s measured here (square products; fp32 on the CPU dry run)."""
    n, dtype = (512, torch.float32) if run.device.type != "cuda" else (8192, torch.bfloat16)
    a = torch.randn(n, n, device=run.device, dtype=dtype)
    b = torch.randn(n, n, device=run.device, dtype=dtype)
    best = 0.0
    for _ in range(3):
        a @ b
        run.sync()
        t = time.perf_counter()
        for _ in range(10):
            a @ b
        run.sync()
        best = max(best, 10 * 2 * n**3 / (time.perf_counter() - t))
    return best


def ftrain_apart_side(run: Run, dims: dict, x, y, compiled: bool):
    """The same step compiled with its backward apart (compiled only; ft.compile's fallback where
    it cannot recompute checkpointed blocks in one graph, and its default where dynamo cannot
    trace a whole step, as on torch 2.11): dynamo breaks the graph at
    ``torch.autograd.grad``, so AOT autograd partitions forward and backward as for the PyTorch
    loop (recomputing what is cheap), and the update is a graph of its own. A diagnostic: where
    ft.compile's one graph (forward, backward and update traced together) holds more memory."""
    return ftrain_side(run, dims, x, y, compiled, apart=True)


def ftrain_bf16_loss_side(run: Run, dims: dict, x, y, compiled: bool):
    """The same step with the loss's log-probabilities in bf16 (``cross_entropy(fp32=False)``),
    the precision of the loop's ``F.cross_entropy`` under autocast: the like-for-like side."""
    return ftrain_side(run, dims, x, y, compiled, fp32_loss=False)


def ftrain_side(run: Run, dims: dict, x, y, compiled: bool, apart=False, fp32_loss=True):
    """ftrain's donated bf16 step as ``ftrain train`` composes it: a function doing one step."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**dims)).to(run.device)

    def loss_fn(params, batch):
        logits = ft.apply(model, params, batch["input"])
        return ft.losses.cross_entropy(logits, batch["target"], fp32=fp32_loss)

    opt = optim.adamw(6e-4, **ADAMW, mask=optim.decay_mask)
    step = ft.autocast(ft.train_step(loss_fn, opt, donate=True), torch.bfloat16)
    if compiled:
        step = ft.compile(step)
        if apart:  # ft.compile's own fallback for blocks it cannot recompute in one graph
            compiled_fn = step._fn  # the outermost function: ft.compile's (no eager wrap here)
            if not hasattr(compiled_fn, "backward_apart"):
                raise RuntimeError("--apart: ft.compile's function is not the step's outermost")
            compiled_fn.backward_apart = True
    box = {"state": ft.TrainState.create(ft.params_of(model), opt)}
    release_params(model)  # as ftrain train does: the params live in the state only
    batch = {"input": x, "target": y}
    if compiled:  # compiles on the first call; no step after it may compile again
        box["state"], history = testing.assert_no_recompile(step, box["state"], [batch] * 3)
        box["first"] = history[0]["loss"]

    def one():
        box["state"], metrics = step(box["state"], batch)
        return metrics["loss"]

    return one, box


def torch_side(run: Run, dims: dict, x, y, compiled: bool):
    """The imperative loop of nanoGPT's bench.py: fused AdamW, autocast, the loss in the
    (compiled) forward, backward, step, zero_grad."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**dims)).to(run.device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": ADAMW["weight_decay"]},
              {"params": rest, "weight_decay": 0.0}]  # fmt: skip
    opt = torch.optim.AdamW(groups, lr=6e-4, betas=(ADAMW["b1"], ADAMW["b2"]), fused=True)

    def forward(x, y):
        logits = model(x)  # (B, T, vocab)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    forward = torch.compile(forward) if compiled else forward

    def one():
        with torch.autocast(run.device.type, dtype=torch.bfloat16):
            loss = forward(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return one, {"first": None}


def bench(run: Run, out: dict) -> None:
    """The GPT-2 124M sides, eager and compiled: ``out["table"]`` (markdown) and
    ``out["profiles"]`` (the eager kernel tables) are written as each stage ends, so that a late
    failure or a time limit keeps what was measured; a stage that raises is reported as a failed
    check and the others go on."""
    dims = BENCH_TINY if run.tiny else BENCH
    rows = 4 if run.tiny else 12
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, dims["vocab_size"], (rows, dims["seq_len"] + 1), generator=g)
    x, y = data[:, :-1].contiguous().to(run.device), data[:, 1:].contiguous().to(run.device)
    peak = matmul_peak(run)
    flops = flops_per_token(GPTConfig(**dims)) * rows * dims["seq_len"]
    table, losses, profiles, eager, kept = [], {}, [], {}, {}
    modes = (False, True) if run.compile else (False,)
    for compiled in modes:
        sides = [("ftrain (donated step)", ftrain_side), ("PyTorch loop", torch_side)]
        if not compiled or run.apart:
            sides.append(("ftrain, loss in bf16 as the loop's", ftrain_bf16_loss_side))
        if compiled and run.apart:
            sides.append(("ftrain, backward compiled apart", ftrain_apart_side))
        for name, side in sides:
            try:
                row, first, alive = measure(run, side, dims, x, y, compiled)
            except Exception as e:  # noqa: BLE001 - one broken side is reported, the rest runs
                _raised(run, f"bench {'compiled' if compiled else 'eager'} {name}", e)
                continue
            ms, cpu_ms, mem, setup, syncs = row
            tokens = rows * dims["seq_len"] / ms * 1e3
            table.append([compiled, name, ms, cpu_ms, float("nan"), tokens,
                          flops / (ms / 1e3) / peak, mem, setup, syncs])  # fmt: skip
            losses[(name, compiled)] = first
            print(f"  {'compiled' if compiled else 'eager'} {name}: {ms:.2f} ms/iter (host CPU "
                  f"{cpu_ms:.2f}), {mem:.2f} GiB, setup {setup:.0f} s, {syncs} host syncs",
                  flush=True)  # fmt: skip
            kept[(compiled, name)] = (*alive, side)
            if not compiled:
                eager[name] = side
    e_ft, e_pt = losses.get(("ftrain (donated step)", False)), losses.get(("PyTorch loop", False))
    if e_ft is not None and e_pt is not None:
        run.check("bench: ftrain's first loss vs the PyTorch loop's (same init, bf16)",
                  f"{e_ft:.4f} vs {e_pt:.4f}", "rel 1e-2", abs(e_ft - e_pt) <= 1e-2 * abs(e_pt))  # fmt: skip
    c_ft = losses.get(("ftrain (donated step)", True))
    if c_ft is not None and e_ft is not None:
        run.check("compile: no recompile over 3 steps; first loss vs eager", f"{c_ft:.4f} vs {e_ft:.4f}",
                  "rel 1e-2", abs(c_ft - e_ft) <= 1e-2 * abs(e_ft))  # fmt: skip
    out["table"] = _bench_markdown(run, dims, rows, peak, table)
    # eager sides timed again in the reverse order (each built anew): a row's times are the means
    # of its two rounds, so that no side owes its ratio to where it came in the sequence
    for r in reversed([r for r in table if not r[0]]):
        try:
            (ms, cpu_ms, *_), _, alive = measure(run, eager[r[1]], dims, x, y, False)
        except Exception as e:  # noqa: BLE001 - the first round's figures stay
            _raised(run, f"bench eager {r[1]}, second round", e)
            continue
        del alive
        print(f"  eager {r[1]}, second round: {ms:.2f} ms/iter (first {r[2]:.2f})", flush=True)
        r[2], r[3] = (r[2] + ms) / 2, (r[3] + cpu_ms) / 2
        r[5], r[6] = rows * dims["seq_len"] / r[2] * 1e3, flops / (r[2] / 1e3) / peak
    out["table"] = _bench_markdown(run, dims, rows, peak, table)
    # the kernel tables and memory breakdowns last, of the sides kept from their first round:
    # once the profiler has run in a process, its kernel launches cost the host more (an H200
    # run timed a side after two profiled ones at 41.6 ms/iter, the profiled host pace, against
    # 30.1 ms/iter timed before any)
    for r in table:
        mode = "compiled" if r[0] else "eager"
        one, _, side = kept.pop((r[0], r[1]))
        label = f"{mode}_{side.__name__}"  # the dump's file names
        try:
            profile, r[4] = kernel_table(run, one, label)
            lines = peak_breakdown(run, one)
        except Exception as e:  # noqa: BLE001 - the timings stay
            _raised(run, f"bench {mode} {r[1]}, profile", e)
            continue
        finally:
            del one
        if not r[0]:
            profiles.append((r[1], profile))
        if run.dump is not None and lines:
            (run.dump / f"memory_{label}.txt").write_text("\n".join(lines) + "\n")
        print(f"  {mode} {r[1]}: device busy {r[4]:.2f} ms per step", flush=True)
        for line in lines[:7]:
            print(f"    {line}", flush=True)
        out["table"], out["profiles"] = _bench_markdown(run, dims, rows, peak, table), profiles


def _raised(run: Run, what: str, e: Exception) -> None:
    run.check(f"{what}: raised", f"{type(e).__name__}: {str(e).splitlines()[0][:120]}", "-", False)


def measure(run: Run, side, dims, x, y, compiled: bool):
    """One side's ``(ms, host CPU ms, peak GiB, setup s, syncs)`` per step and its first loss.
    The peak is the most the timed steps held, above what the device held before the side was
    built: its state counts, the transients of its build and compile do not.
    Host CPU time is this process's over the timed steps: near the wall time means the host,
    not the GPU, sets the pace. Syncs are the host waits on the device that one step makes
    (``torch.cuda.set_sync_debug_mode``)."""
    warm, timed = (2, 5) if run.tiny else (5, 20)
    if run.device.type == "cuda":
        torch.cuda.empty_cache()
        run.sync()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    one, box = side(run, dims, x, y, compiled)
    first = one() if box.get("first") is None else box["first"]
    first = float(first)
    for _ in range(warm):
        one()
    run.sync()
    setup = time.perf_counter() - t0
    if run.device.type == "cuda":  # the steps' peak (state included), not the build's or compile's
        torch.cuda.reset_peak_memory_stats()
    t, c = time.perf_counter(), time.process_time()
    for _ in range(timed):
        one()
    run.sync()
    ms = (time.perf_counter() - t) / timed * 1e3
    cpu_ms = (time.process_time() - c) / timed * 1e3
    mem = (
        (torch.cuda.max_memory_allocated() - base) / 2**30
        if run.device.type == "cuda"
        else float("nan")
    )
    syncs = count_syncs(run, one)
    return (ms, cpu_ms, mem, setup, syncs), first, (one, box)


def live_at_peak(trace: list[dict]) -> tuple[int, list[dict]]:
    """From an allocator trace (``alloc`` and ``free_*`` events, oldest first): the most bytes
    allocated within it and live at once, and the ``alloc`` events live at that moment. Memory
    allocated before the trace began counts from its free on (the net change, as
    ``torch.cuda.max_memory_allocated`` sees it, over the trace)."""
    live, total, best, at_peak = {}, 0, 0, {}
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if total > best:
                best, at_peak = total, dict(live)
        elif e["action"] in ("free_requested", "free_completed") and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
        elif e["action"] == "free_requested":  # allocated before the trace
            total -= e["size"]
    return best, list(at_peak.values())


def peak_breakdown(run: Run, one, top: int = 25) -> list[str]:
    """The memory one step allocates and holds at its peak, by the source line that allocated
    it (the innermost frame outside torch: the model's, ftrain's or inductor's generated code),
    largest first, as ``"GiB  file:line  source"`` lines; the first line is the total. From the
    CUDA allocator's recorded history (empty on the CPU). What was allocated before the step
    (params, optimizer state) is not counted."""
    if run.device.type != "cuda":
        return []
    import linecache

    run.sync()
    # Python frames only: C++ frames ("??") name nothing here, and symbolising them is slow
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=2_000_000)
    try:
        one()
        run.sync()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    best, at_peak = live_at_peak(snap["device_traces"][run.device.index or 0])
    by_line: dict[str, int] = {}
    for e in at_peak:
        frames = [
            f
            for f in e.get("frames", [])
            if f["filename"].endswith(".py") and "/torch/" not in f["filename"]
        ]
        if frames:
            f = frames[0]
            src = linecache.getline(f["filename"], f["line"]).strip()[:90]
            key = f"{Path(f['filename']).name}:{f['line']}  {src}"
        else:  # autograd's backward runs on a thread of its own, with no Python frames
            key = "(no Python frame: the backward's own allocations)"
        by_line[key] = by_line.get(key, 0) + e["size"]
    ranked = sorted(by_line.items(), key=lambda kv: -kv[1])[:top]
    return [f"{best / 2**30:6.2f} GiB  allocated by the step and live at its peak"] + [
        f"{size / 2**30:6.2f} GiB  {key}" for key, size in ranked
    ]


def count_syncs(run: Run, one) -> int:
    """How many times one step makes the host wait for the device (0 on the CPU)."""
    if run.device.type != "cuda":
        return 0
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            one()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    run.sync()
    where = [
        f"{w.filename.split('/')[-1]}:{w.lineno}" for w in seen if "synchroniz" in str(w.message)
    ]
    if where:  # which lines of the step wait (the frame that called the op)
        print(f"    host syncs at: {', '.join(where)}", flush=True)
    return len(where)


def _bench_markdown(run: Run, dims, rows, peak, table) -> str:
    lines = [f"{dims['n_layer']} layers, {dims['d_model']} wide, block {dims['seq_len']}, vocab "
             f"{dims['vocab_size']}, batch {rows}, bf16 autocast, AdamW (lr 6e-4, betas 0.9/0.95, "
             f"wd 0.1 on matrices). Peak: {peak / 1e12:.3g} TFLOP/s measured "
             f"({'bf16' if run.device.type == 'cuda' else 'fp32'} matmul). *host CPU*: this "
             "process's CPU time per step; *device busy*: the kernels' summed time per step "
             "(the profiler's); *syncs*: host waits on the device in one step.", "",
             "| mode | side | ms/iter | / PyTorch | host CPU ms | device busy ms | tokens/s | MFU | "
             "peak GiB | / PyTorch | syncs | build + warm-up s |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    ref = {c: (ms, mem) for c, n, ms, _, _, _, _, mem, *_ in table if n == "PyTorch loop"}
    for compiled, name, ms, cpu_ms, busy, tok, mfu, mem, setup, syncs in table:
        r_ms, r_mem = ref.get(compiled, (float("nan"), float("nan")))
        lines.append(f"| {'compiled' if compiled else 'eager'} | {name} | {ms:.2f} | "
                     f"{ms / r_ms:.2f} | {cpu_ms:.2f} | {busy:.2f} | {tok:,.0f} | {mfu:.2f} | "
                     f"{mem:.2f} | {mem / r_mem:.2f} | {syncs} | {setup:.0f} |")  # fmt: skip
    return "\n".join(lines)


def kernel_table(run: Run, one, label: str, steps: int = 3, top: int = 15):
    """The ``top`` kernels (ops on the CPU) by self device time over ``steps`` steps, per step,
    and the summed time of all of them per step (ms); with ``run.dump``, the profiler's whole
    table (every op and kernel) in ``<dump>/kernels_<label>.txt``."""
    from torch.profiler import ProfilerActivity, profile

    cuda = run.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            one()
        run.sync()

    def self_time(e) -> float:  # µs; the attribute's name changed across torch versions
        if not cuda:
            return e.self_cpu_time_total
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)

    averages = list(prof.key_averages())
    if run.dump is not None:
        key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        text = prof.key_averages().table(sort_by=key, row_limit=400, max_name_column_width=90)
        (run.dump / f"kernels_{label}.txt").write_text(text)
    if cuda:  # the kernels themselves, not also the CPU ops that launched them
        kernels = [e for e in averages if str(getattr(e, "device_type", "")).endswith("CUDA")]
        averages = kernels or averages
    events = sorted(averages, key=self_time, reverse=True)[:top]
    total = sum(self_time(e) for e in averages) / steps
    rows = [
        f"| `{e.key[:70]}` | {e.count // steps} | {self_time(e) / steps / 1e3:.3f} |"
        for e in events
    ]
    header = [
        f"| kernel | calls/step | self ms/step (all: {total / 1e3:.2f}) |",
        "| --- | ---: | ---: |",
    ]
    return [*header, *rows], total / 1e3


def adamw_alone(run: Run) -> str:
    """ft.optim.adamw's update (in place, as the donated step runs it) against torch.optim.AdamW
    fused and foreach, on the bench model's params, fixed gradients copied in before each call."""
    torch.manual_seed(0)
    params = ft.params_of(GPT(GPTConfig(**(BENCH_TINY if run.tiny else BENCH))).to(run.device))
    grads = params.apply(lambda p: torch.randn_like(p) * 1e-2)
    fns = {}
    src = list(grads.values(True, True))
    # ft.optim.adamw as it comes (fused=None where it has the option) and forced to foreach
    choices = {"ft.optim.adamw": {}}
    if "fused" in inspect.signature(optim.adamw).parameters:
        choices = {
            "ft.optim.adamw (fused=None)": {},
            "ft.optim.adamw (fused=False)": {"fused": False},
        }
    if hasattr(optim, "update_and_apply"):  # what a donated ft.train_step runs
        choices = {"ft.optim.update_and_apply(adamw), as the step runs it": {"apply": True},
                   **choices}  # fmt: skip
    for label, kw in choices.items():
        kw = dict(kw)
        apply = kw.pop("apply", False)
        opt = optim.adamw(6e-4, **ADAMW, mask=optim.decay_mask, **kw)
        box = {"params": params.clone(), "grads": grads.clone()}
        box["state"] = opt.init(box["params"])
        dst = list(box["grads"].values(True, True))

        def ours(opt=opt, box=box, dst=dst, apply=apply):
            torch._foreach_copy_(dst, src)
            if apply:  # the kernel writes the params, as torch.optim's fused step does
                _, box["state"] = optim.update_and_apply(
                    opt, box["grads"], box["state"], box["params"], inplace=True
                )
                return
            updates, box["state"] = opt.update(
                box["grads"], box["state"], box["params"], inplace=True
            )
            optim.apply_updates(box["params"], updates, inplace=True)

        fns[label] = ours
    for kind in ("fused", "foreach"):
        leaves = [p.clone().requires_grad_() for p in params.values(True, True)]
        for p, g in zip(leaves, src):
            p.grad = g.clone()
        # two groups, as ftrain's decay mask and nanoGPT's configure_optimizers make them (one
        # group would run each kernel once instead of twice: not the same work)
        groups = [{"params": [p for p in leaves if p.dim() >= 2], "weight_decay": 0.1},
                  {"params": [p for p in leaves if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip
        o = torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95), **{kind: True})

        def theirs(o=o, leaves=leaves):
            torch._foreach_copy_([p.grad for p in leaves], src)
            o.step()

        fns[f"torch.optim.AdamW({kind}=True)"] = theirs
    n = 5 if run.tiny else 50
    out = {}
    for name, f in fns.items():
        for _ in range(3):
            f()
        run.sync()
        t = time.perf_counter()
        for _ in range(n):
            f()
        run.sync()
        out[name] = (time.perf_counter() - t) / n * 1e3
    count = sum(p.numel() for p in params.values(True, True))
    fused = out["torch.optim.AdamW(fused=True)"]
    lines = [f"AdamW update alone on {count / 1e6:.1f}M params (gradient copy included on every side):", "",
             "| update | ms | / torch fused |", "| --- | ---: | ---: |"]  # fmt: skip
    lines += [f"| {k} | {v:.3f} | {v / fused:.2f} |" for k, v in out.items()]
    return "\n".join(lines)


# -- main -----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else None)
    p.add_argument("--tiny", action="store_true", help="tiny sizes: a dry run of every part")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="skip the two compiles (and the compile check)")  # fmt: skip
    p.add_argument("--only", choices=("checks", "bench"), default=None,
                   help="run only the checks or only the bench (default: both)")  # fmt: skip
    p.add_argument("--dump", default=None, metavar="DIR",
                   help="write there the profiler's whole kernel table of each bench side and "
                        "(CUDA) the breakdown of the memory its step holds at its peak")  # fmt: skip
    p.add_argument("--apart", action="store_true",
                   help="also bench the step compiled with its backward apart (ft.compile's "
                        "default where dynamo cannot trace a whole step, as on torch 2.11)")  # fmt: skip
    p.add_argument("--results", default=None, metavar="FILE",
                   help="the RESULTS.md to write the GPU section into (default: benchmarks/"
                   "RESULTS.md on a GPU without --tiny; nothing otherwise)")  # fmt: skip
    args = p.parse_args(argv)
    if args.device is None:
        p.error("no CUDA device here; for a dry run on the CPU pass --device cpu --tiny")
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:  # set_device wants an index (torch 2.11)
        device = torch.device("cuda", torch.cuda.current_device())
    run = Run(device, args.tiny, args.compile)
    run.apart = args.apart
    if args.dump:
        run.dump = Path(args.dump)
        run.dump.mkdir(parents=True, exist_ok=True)
    if run.device.type == "cuda":
        torch.cuda.set_device(run.device)
    # a time limit's SIGTERM ends the run through `finally`: what was measured is still written
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("gpu.py: stopped by SIGTERM"))
    t0 = time.perf_counter()
    print(f"benchmarks/gpu.py on {machine()}", flush=True)
    checks = [("transforms", check_transforms), ("offload", check_offload),
              ("save/load", check_save_load), ("loader", check_loader), ("shard", check_shard),
              ("memory plan", check_memory_plan)]  # fmt: skip
    parts = {"checks": checks, "bench": [("bench", None), ("AdamW alone", None)]}
    todo = [part for key in ("checks", "bench") if args.only in (None, key) for part in parts[key]]
    updates = ""
    measured = {"table": "", "profiles": []}  # bench's, as far as it got
    try:
        for name, fn in todo:
            t = time.perf_counter()
            try:
                if name == "bench":
                    bench(run, measured)
                    print(measured["table"], flush=True)
                elif name == "AdamW alone":
                    updates = adamw_alone(run)
                    print(updates, flush=True)
                else:
                    fn(run)
            except Exception as e:  # noqa: BLE001 - a broken part is reported, the run goes on
                run.check(f"{name}: raised",
                          f"{type(e).__name__}: {str(e).splitlines()[0][:120]}", "-", False)  # fmt: skip
            print(f"== {name}: {time.perf_counter() - t:.0f} s", flush=True)
    finally:
        target = args.results or (RESULTS if run.device.type == "cuda" and not run.tiny else None)
        if target is not None:
            title = "GPU" if args.only is None else f"GPU ({args.only} only)"
            write(run, Path(target), measured["table"], updates, measured["profiles"],
                  time.perf_counter() - t0, title)  # fmt: skip
    failed = [r for r in run.rows if r.endswith("**FAIL** |")]
    print(f"{len(run.rows) - len(failed)} of {len(run.rows)} checks passed; "
          f"{time.perf_counter() - t0:.0f} s in all")  # fmt: skip
    return 1 if failed else 0


def write(
    run: Run, path: Path, table: str, updates: str, profiles, seconds: float, title: str = "GPU"
) -> None:
    name = torch.cuda.get_device_name(run.device) if run.device.type == "cuda" else "CPU dry run"
    body = [f"`python benchmarks/gpu.py{' --tiny' if run.tiny else ''}` on **{name}**; {machine()}; "
            f"{seconds:.0f} s in all.", "", "### Checks", "",
            "| check | measured | bound | |", "| --- | --- | --- | --- |", *run.rows, "",
            "### GPT-2 124M (nanoGPT bench.py's setting)", "", table, "", updates]  # fmt: skip
    for side, rows in profiles:
        body += ["", f"### Kernels of one eager step: {side}", "", *rows]
    import _common  # write_section writes _common.RESULTS: pointed at `path` for this call

    previous = _common.RESULTS
    _common.RESULTS = path
    try:
        write_section(title, "\n".join(body))
    finally:
        _common.RESULTS = previous
    print(f"wrote the GPU section of {path}")


if __name__ == "__main__":
    sys.exit(main())
