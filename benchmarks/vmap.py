"""ft.vmap, ft.per_example_grads and ft.dp_sgd against the loops they replace, same models and data.

    python benchmarks/vmap.py            # ~3 minutes on a 2-core CPU; writes two RESULTS.md sections
    python benchmarks/vmap.py --quick    # a smoke run at tiny sizes, nothing written

Sides, each on ftrain's GPT (dropout 0):

* **ensembles**: K members (their own initial params, seeds and learning rates: an
  ``inject_hyperparams`` AdamW) trained by one ``ft.vmap(step)`` call per step, against K plain
  ``step(state_i, batch)`` calls on the same states and batches. Twice: every member on the same
  batch (``batch_axis=None``) and every member on its own (``batch_axis=0``). Throughput is
  members x steps per CPU second; the target (tiny GPT, d=64, 2 blocks) is >= 2.5x the
  sequential steps'. The same at the default ``ftrain train`` size (reported, no target).
  Then torch.profiler's self CPU time per op, vmapped against sequential: where the time goes.
* **per-example gradients**: ``ft.per_example_grads`` of 16 examples against a Python loop of
  ``torch.autograd.grad`` on each example alone (gradients stacked, as ft returns them), and the
  one batch gradient as the floor.
* **DP-SGD**: an ``ft.dp_sgd`` step (clip 1.0, noise multiplier 1.1) against the plain step on
  the same model and batch.

Timing: every side runs once per round, the order rotating, and each ratio is a ratio of medians
over rounds, so a machine shared with other work slows all sides alike. Ratios are judged on CPU
time (this process, all threads), which waiting for a core does not inflate; wall time is beside
it. One torch thread (see benchmarks/step_overhead.py for why).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import warnings
from collections.abc import Callable

import torch
from _common import (  # benchmarks/_common.py, beside this script
    OUTSIDE,
    TOTAL,
    machine,
    profile_diff,
    rounds,
    write_section,
)

import ftrain as ft
from ftrain.app.config import TrainConfig
from ftrain.app.recipes.gpt import build_model
from ftrain.models import GPT, GPTConfig

ENSEMBLE_SECTION = "Ensembles (ft.vmap)"
PER_EXAMPLE_SECTION = "Per-example gradients and DP-SGD"
TARGET = 2.5  # vmapped throughput / sequential throughput, tiny GPT
TINY = dict(d_model=64, n_layer=2, n_head=4, seq_len=32, batch=8, members=8)
DEFAULT = TrainConfig()  # `ftrain train`'s model: d=128, 4 blocks, 2 heads, seq 128, batch 16
QUICK_TINY = dict(d_model=32, n_layer=1, n_head=4, seq_len=16, batch=4, members=3)
# a step that is mostly Python and dispatch, where batching K steps into one can pay most
SMALL = dict(d_model=32, n_layer=1, n_head=2, seq_len=16, batch=2, members=8)
# Why the ensemble ratio is what it is (from the profile tables this script writes, and cProfile
# of the same steps); the numbers are in the tables.
NOTES = """Where the ratio comes from. One vmapped step saves the fixed costs of K - 1 plain steps
(Python, dispatch, TensorDict flattening), but it runs the same arithmetic and adds fixed costs
of its own. The arithmetic: at these sizes a plain step is mostly kernel time (matmuls,
attention, GELU, LayerNorm, the loss); under `torch.func.vmap` the members' linear layers become
one `bmm` over `[K, B*T, d]` (MKL, where the plain step runs oneDNN's linear), and
`scaled_dot_product_attention` has no batching rule on the CPU, so torch runs it member by member
and concatenates (the warning below). The fixed cost (`vmap K=1` above): `torch.func`'s
wrapper layers on every op of forward and backward, and no `torch._foreach_*` kernel has a vmap
batching rule, so under `ft.vmap` `ftrain.internals.foreach` runs the optimizer's and the step's
multi-tensor kernels one tensor at a time (one Python-level op per tensor per kernel, each
batched by vmap; compiled, the loop is traced into the graph and costs nothing per call). At K = 8 that fixed cost is only partly amortized; the last column is the
ratio the ensemble approaches as K grows.

What the target assumes. A ratio of 2.5 at K = 8 needs the plain step to be mostly overhead,
or a device that one small model leaves idle (a GPU, where K members fill it). On this CPU, with
one thread, the tiny size's step is mostly kernel time, so no batching can reach it there (the
ceiling table below); where the step is overhead-bound (the small size) the compiled vmapped
step is the row that shows what `ft.vmap` gives."""
EXAMPLES = 16  # examples for per-example gradients and DP-SGD


@dataclasses.dataclass
class Size:
    name: str
    config: GPTConfig
    batch: int  # rows per member per step
    members: int
    rounds: int
    profile_steps: int


def _config(size: dict) -> GPTConfig:
    cfg = GPTConfig(**{k: size[k] for k in ("d_model", "n_layer", "n_head", "seq_len")})
    return dataclasses.replace(cfg, dropout=0.0)


def sizes(quick: bool, n_rounds: int) -> list[Size]:
    tiny = QUICK_TINY if quick else TINY
    out = [Size("tiny", _config(tiny), tiny["batch"], tiny["members"], 3 * n_rounds, 10)]
    if not quick:
        out.append(
            Size("small", _config(SMALL), SMALL["batch"], SMALL["members"], 3 * n_rounds, 10)
        )
        default_cfg = build_model(DEFAULT).config
        out.append(Size("default", default_cfg, DEFAULT.batch_size, 8, n_rounds, 3))
    return out


def gpt(config: GPTConfig, seed: int) -> GPT:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(config)


def token_batch(vocab: int, rows: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, seq + 1), generator=g)  # (B, T + 1)
    return {"input": tokens[:, :-1], "target": tokens[:, 1:]}


def loss_fn_of(model: GPT):
    def loss_fn(params, batch):
        logits = ft.apply(model, params, batch["input"])  # (B, T, vocab)
        return ft.losses.cross_entropy(logits, batch["target"])

    return loss_fn


# -- ensembles -------------------------------------------------------------------------------------


def ensemble_sides(size: Size, compiled: bool = False) -> dict[str, Callable[[], None]]:
    """Four sides: vmapped and sequential, each with the shared batch and with own batches.
    ``compiled``: both sides through ``ft.compile`` (inductor; the sequential side's one
    compiled step serves every member, whose states have the same shapes)."""
    k, cfg = size.members, size.config
    model = gpt(cfg, 0)  # the template: its code runs, the states hold the tensors
    opt = ft.optim.inject_hyperparams(ft.optim.adamw)(learning_rate=1e-3, weight_decay=0.01)
    lrs = [1e-4 * 30 ** (i / max(k - 1, 1)) for i in range(k)]  # 1e-4 ... 3e-3
    states = [
        ft.optim.set_hyperparams(
            ft.TrainState.create(ft.params_of(gpt(cfg, i)), opt, seed=i), learning_rate=lr
        )
        for i, lr in enumerate(lrs)
    ]
    own = [token_batch(cfg.vocab_size, size.batch, cfg.seq_len, seed=i) for i in range(k)]
    shared = own[0]
    stacked_batches = {key: torch.stack([b[key] for b in own]) for key in shared}  # (K, B, T)
    plain = ft.train_step(loss_fn_of(model), opt)
    wrap = ft.compile if compiled else (lambda x: x)
    step = wrap(plain)
    vmapped = {None: wrap(ft.vmap(plain)), 0: wrap(ft.vmap(plain, batch_axis=0))}

    def vmap_side(batch_axis: int | None) -> Callable[[], None]:
        box = [ft.stack(states)]  # every leaf [K, ...]
        batch = shared if batch_axis is None else stacked_batches

        def run() -> None:
            box[0], _ = vmapped[batch_axis](box[0], batch)  # metrics [K]

        return run

    def sequential_side(batches: list[dict]) -> Callable[[], None]:
        box = list(states)

        def run() -> None:
            for i in range(k):
                box[i], _ = step(box[i], batches[i])

        return run

    return {
        "vmap, shared batch": vmap_side(None),
        "sequential, shared batch": sequential_side([shared] * k),
        "vmap, own batches": vmap_side(0),
        "sequential, own batches": sequential_side(own),
    }


def ensemble_rows(size: Size) -> tuple[list[str], set[str], float]:
    with warnings.catch_warnings(record=True) as caught:  # torch's "no batching rule" warnings
        warnings.simplefilter("always")
        t = rounds(ensemble_sides(size), size.rounds)
    k, cfg = size.members, size.config
    shape = (f"{size.name}: d={cfg.d_model}, {cfg.n_layer} blocks, {cfg.n_head} heads, "
             f"seq {cfg.seq_len}, batch {size.batch}, K={k}")  # fmt: skip
    rows = []
    for batch in ("shared batch", "own batches"):
        seq, vm = t[f"sequential, {batch}"], t[f"vmap, {batch}"]
        cpu, wall = seq["cpu"] / vm["cpu"], seq["wall"] / vm["wall"]
        judged = size.name == "tiny"
        target = f"≥ {TARGET}" if judged else ""
        met = ("yes" if cpu >= TARGET else "**no**") if judged else ""
        rows.append(
            f"| {shape} | {batch} | {k / vm['cpu']:.1f} | {k / seq['cpu']:.1f} | "
            f"{cpu:.2f} | {wall:.2f} | {target} | {met} |"
        )
        print(rows[-1], flush=True)
    missing = {str(w.message).split("for ")[1].split(".")[0]
               for w in caught if "batching rule" in str(w.message)}  # fmt: skip
    return rows, missing, t["vmap, shared batch"]["cpu"]


def compiled_rows(size: Size) -> list[str]:
    """The shared-batch sides compiled (inductor), both of them: like against like. Compile time
    is left out (the warm-up calls compile)."""
    torch._dynamo.reset()  # each size compiled afresh, with static shapes, as a user's run is
    sides = ensemble_sides(size, compiled=True)
    names = ("vmap, shared batch", "sequential, shared batch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = rounds({n: sides[n] for n in names}, size.rounds)
    seq, vm = t[names[1]], t[names[0]]
    row = (f"| {size.name}, compiled | shared batch | {size.members / vm['cpu']:.1f} | "
           f"{size.members / seq['cpu']:.1f} | {seq['cpu'] / vm['cpu']:.2f} | "
           f"{seq['wall'] / vm['wall']:.2f} | (reported) | |")  # fmt: skip
    print(row, flush=True)
    return [row]


def scaling_row(size: Size, vmap_k_cpu: float) -> str:
    """The vmapped step's fixed cost and its cost per member: ``ft.vmap`` with K=1 against one
    plain step, and (K members - 1 member) / (K - 1) against one plain step."""
    one = dataclasses.replace(size, members=1)
    sides = ensemble_sides(one)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = rounds({k: sides[k] for k in ("vmap, shared batch", "sequential, shared batch")},
                   size.rounds)  # fmt: skip
    vmap1, plain = t["vmap, shared batch"]["cpu"], t["sequential, shared batch"]["cpu"]
    per_member = (vmap_k_cpu - vmap1) / max(size.members - 1, 1)
    row = (f"| {size.name} | {plain * 1e3:.2f} | {vmap1 * 1e3:.2f} | {per_member * 1e3:.2f} | "
           f"{plain / per_member:.2f} |")  # fmt: skip
    print(row, flush=True)
    return row


def ensemble_profile(size: Size) -> tuple[list[str], float]:
    """Self CPU µs per step of each op (torch.profiler): the vmapped step against the K
    sequential steps (shared batch), the ops where they differ most first; and the ceiling of
    the ratio, the sequential steps' total over their time inside ops (see NOTES)."""
    sides = ensemble_sides(size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows, seq = profile_diff(
            sides["sequential, shared batch"], sides["vmap, shared batch"], size.profile_steps, 14
        )
    return rows, seq[TOTAL] / (seq[TOTAL] - seq[OUTSIDE])


# -- per-example gradients and DP-SGD ------------------------------------------------------------


def per_example_sides(config: GPTConfig) -> dict[str, Callable[[], None]]:
    model = gpt(config, 0)
    loss_fn = loss_fn_of(model)
    params = ft.params_of(model)
    batch = token_batch(config.vocab_size, EXAMPLES, config.seq_len, seed=0)
    leafy = params.apply(lambda t: t.detach().requires_grad_())
    leaves = list(leafy.values(True, True))

    def ft_side() -> None:
        ft.per_example_grads(loss_fn, params, batch)  # every leaf [n, *shape]

    def loop_side() -> None:
        grads = []
        for i in range(EXAMPLES):
            one = {k: v[i : i + 1] for k, v in batch.items()}  # a batch of one
            grads.append(torch.autograd.grad(loss_fn(leafy, one).value, leaves))
        [torch.stack(g) for g in zip(*grads)]  # [n, *shape] per leaf, as ft returns them

    def batch_side() -> None:
        torch.autograd.grad(loss_fn(leafy, batch).value, leaves)  # the mean, not per example

    return {"ft.per_example_grads": ft_side, "loop of autograd.grad": loop_side,
            "batch gradient": batch_side}  # fmt: skip


def dp_sides(config: GPTConfig) -> dict[str, Callable[[], None]]:
    model = gpt(config, 0)
    opt = ft.optim.adamw(1e-3, weight_decay=0.01)
    plain = ft.train_step(loss_fn_of(model), opt)
    private = ft.dp_sgd(plain, l2_norm_clip=1.0, noise_multiplier=1.1)
    batch = token_batch(config.vocab_size, EXAMPLES, config.seq_len, seed=0)

    def side(step: ft.Step) -> Callable[[], None]:
        box = [ft.TrainState.create(ft.params_of(model), opt, seed=0)]

        def run() -> None:
            box[0], _ = step(box[0], batch)

        return run

    return {"ft.dp_sgd step": side(private), "plain step": side(plain)}


def per_example_rows(config: GPTConfig, n_rounds: int) -> tuple[list[str], list[str]]:
    t = rounds(per_example_sides(config), n_rounds)
    d = rounds(dp_sides(config), n_rounds)
    ms = {k: v["cpu"] * 1e3 for k, v in (t | d).items()}
    ratios = []
    for label, num, den in (
        ("loop of autograd.grad / ft.per_example_grads", t["loop of autograd.grad"],
         t["ft.per_example_grads"]),
        ("ft.per_example_grads / batch gradient", t["ft.per_example_grads"], t["batch gradient"]),
        ("ft.dp_sgd step / plain step", d["ft.dp_sgd step"], d["plain step"]),
    ):  # fmt: skip
        ratios.append(
            f"| {label} | {num['cpu'] / den['cpu']:.2f} | {num['wall'] / den['wall']:.2f} |"
        )
        print(ratios[-1], flush=True)
    times = [f"| {k} | {v:.1f} |" for k, v in ms.items()]
    return ratios, times


# -- report ----------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9, help="rounds at the default size "
                        "(default 9; 3x at the tiny size)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 3 rounds, no write")
    args = parser.parse_args()
    torch.set_num_threads(1)
    n_rounds = 1 if args.quick else args.rounds
    load = os.getloadavg()[0]
    print(machine(), f"load {load:.1f}", flush=True)

    rows, scaling, profiles, ceilings, missing = [], [], {}, [], set()
    for size in sizes(args.quick, n_rounds):
        r, m, vmap_cpu = ensemble_rows(size)
        rows += r
        missing |= m
        scaling.append(scaling_row(size, vmap_cpu))
        profiles[size.name], cap = ensemble_profile(size)
        ceilings.append(f"| {size.name} | {cap:.2f} | {r[0].split('|')[5].strip()} |")
        if size.name != "default" and not args.quick:  # inductor at the default size: minutes
            rows += compiled_rows(size)
    tiny = sizes(args.quick, n_rounds)[0]
    ratios, times = per_example_rows(tiny.config, 3 * n_rounds)
    load_end = os.getloadavg()[0]

    header = (f"`python benchmarks/vmap.py` on {machine()}. Medians over interleaved rounds, each "
              f"round one call of every side in rotating order. Load average {load:.1f} at the "
              f"start and {load_end:.1f} at the end: the machine is shared, so ratios are judged "
              "on CPU time (this process), with wall time beside it.")  # fmt: skip
    profile_text = "".join(
        f"""
Where the time goes at the {name} size (torch.profiler, {s.profile_steps} steps each,
alternating): self CPU µs per step (K members) of the ops where one vmapped step and K sequential
steps differ most, and the time outside any op. The profiler's own cost per op inflates both
totals (the sequential side's more: it runs K times as many ops): read the differences.

| op | sequential µs | vmap µs | difference |
| --- | ---: | ---: | ---: |
{chr(10).join(profiles[name])}
"""
        for name, s in ((s.name, s) for s in sizes(args.quick, n_rounds))
    )
    ensembles = f"""{header}

K members of ftrain's GPT (dropout 0), each with its own initial params, seed and learning rate
(an `inject_hyperparams` AdamW, learning rates 1e-4 to 3e-3), trained by one `ft.vmap(step)` call
per step against K plain `step(state_i, batch_i)` calls on the same states and batches (both pure:
a new state every step). Throughput: members x steps per CPU second. Rows marked *compiled*:
both sides through `ft.compile` (inductor), `ft.compile(ft.vmap(step))` against one compiled
plain step called K times, compile time left out.

| size | batch | vmap members·steps/s | sequential members·steps/s | ratio CPU (judged) | ratio wall | target | met |
| --- | --- | ---: | ---: | ---: | ---: | ---: | :---: |
{chr(10).join(rows)}

The vmapped step's cost split into a fixed part and a part per member, shared batch: CPU ms of
one plain step, of `ft.vmap` with K=1, and per member added ((K members - 1 member) / (K - 1)).
The last column, plain step / cost per member, is the ratio a vmapped ensemble approaches as K
grows.

| size | plain step ms | vmap K=1 ms | vmap ms per member added | plain / per member |
| --- | ---: | ---: | ---: | ---: |
{chr(10).join(scaling)}

{NOTES}

The ceiling. A vmapped step runs the same arithmetic as the K plain steps; what it can save is
their time outside the kernels (Python, dispatch, TensorDict flattening). If it saved all of it
and its batched kernels were exactly as fast, its ratio would be the sequential steps' total
time over their time inside ops, from the profiles below (an estimate: the profiler adds a cost
of its own to every op):

| size | ceiling: sequential total / time in ops | measured ratio, shared batch |
| --- | ---: | ---: |
{chr(10).join(ceilings)}

torch warned that these ops have no vmap batching rule and ran them member by member:
{", ".join(f"`{m}`" for m in sorted(missing)) or "none"}.
{profile_text}"""
    per_example = f"""{header}

Tiny GPT (d={tiny.config.d_model}, {tiny.config.n_layer} blocks, seq {tiny.config.seq_len}),
{EXAMPLES} examples. `ft.per_example_grads` (`torch.func.vmap` of `torch.func.grad`, one call)
against a Python loop of `torch.autograd.grad` over each example alone, its gradients stacked
into `[n, *shape]` as ft returns them; the one batch gradient (not per example) as the floor.
`ft.dp_sgd` (clip 1.0, noise multiplier 1.1) against the plain step, AdamW, same model and batch.

| ratio | CPU time | wall time |
| --- | ---: | ---: |
{chr(10).join(ratios)}

| side | CPU ms per call |
| --- | ---: |
{chr(10).join(times)}
"""
    if args.quick:
        print(ensembles, per_example, sep="\n")
    else:
        write_section(ENSEMBLE_SECTION, ensembles)
        write_section(PER_EXAMPLE_SECTION, per_example)
        print(f"wrote {ENSEMBLE_SECTION!r} and {PER_EXAMPLE_SECTION!r} in benchmarks/RESULTS.md")


if __name__ == "__main__":
    main()
