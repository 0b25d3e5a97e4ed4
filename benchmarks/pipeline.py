"""Pipeline benchmark: the bubble of each ``ft.pipeline`` schedule against its theory, and the
bytes each rank keeps (params + optimizer state) and saves for backward, against one process.

    python benchmarks/pipeline.py               # pp = 2 and pp = 4 (a few minutes); writes RESULTS.md
    python benchmarks/pipeline.py --pp 2        # pp = 2 only
    python benchmarks/pipeline.py --quick       # a smoke run at a tiny size (pp = 2), nothing written

Model: ftrain's GPT (d=256, 8 blocks, seq 128, tied head), AdamW, 1 row of 128 tokens per
micro-batch, ``m = 2 p`` micro-batches (``--microbatches``); each process runs one torch thread,
gloo between them. A stage's forward of a micro-batch costs tens of milliseconds here, a send of
its activations (128 x 256 floats) well under one: compute dominates.

**The bubble** is the fraction of a rank's pipeline time it spends idle, waiting for a neighbour.
Each rank times, around torch's own calls, every chunk of compute its stages run: the forward of
a micro-batch (``PipelineStage.forward_one_chunk``), the loss on the last stage, the backward
(``backward_one_chunk``; for the zero-bubble schedules its input-gradient half, and
``backward_weight_one_chunk`` the weight half), and the whole ``schedule.step`` (one optimizer
step's pipeline, from the first forward to the last backward; the optimizer update outside it).
Three measures, each averaged over the ranks:

* *wall*: ``1 - busy / schedule.step`` on each rank (median over the rounds): the real idle time,
  sends and receives included. With more processes than cores (pp = 4 on 2 cores) the ranks
  also wait for a core, so it is contended there;
* *replayed, measured costs*: the same ratio for a replay of the order in which each rank ran
  its chunks (torch's schedule, as recorded), each chunk taking its measured median time, a chunk
  starting when its rank is free and its input has arrived (the previous stage's forward, the
  next stage's input gradient), sends free: the bubble of the schedule with this model's real
  stage costs (the first stage holds the embeddings, the last the head and the loss), untouched
  by the machine's load;
* *replayed, equal stages*: the same replay with every stage equally costly (a forward 1, a
  backward 2, each of its halves 1, the loss 0): the schedule's own bubble, what theory predicts.

Theory: with ``p`` ranks, ``m`` micro-batches and ``v`` stages per rank, equal stages and free
sends, the bubble takes ``(p - 1) / (v m + p - 1)`` of the time: GPipe and 1F1B (``v = 1``), the
interleaved 1F1B (``v = 2`` here) in Narayanan et al., "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM" (SC'21, section 2.2: bubble over ideal time
``(p - 1) / (v m)``, here over the whole). The same formula is the reference for looped BFS and
for the zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR'24), which
fill part of that idle time with weight gradients.

**Bytes per rank**, of tensors: the params and optimizer state the rank keeps between steps (what
``pp.shard_state`` left it), and the peak of the activations saved for backward during a step:
every tensor autograd saves (``torch.autograd.graph.saved_tensors_hooks``), counted once per
storage from the moment it is saved until autograd frees it, the params and the batch left out
(they exist anyway). pp = 1 is one process with the whole model taking the same micro-batches
with ``ft.accumulate`` (one micro-batch's activations alive at a time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import ftrain as ft
from ftrain.distributed import local_bytes, run_distributed
from ftrain.models import GPT, GPTConfig

SECTION = "Pipeline parallel"
# schedule -> stages per rank (ft.pipeline's default virtual=2 for the interleaved ones)
VIRTUAL = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "looped-bfs": 2,
           "interleaved-zero-bubble": 2, "zbv": 2}  # fmt: skip


def theory(schedule: str, p: int, m: int) -> float:
    """Megatron-LM's bubble fraction (see the module docstring)."""
    return (p - 1) / (VIRTUAL[schedule] * m + p - 1)


def _setup(cfg: GPTConfig, m: int, rows: int):
    """The model (the same on every process), a batch of ``m`` micro-batches and the loss."""
    torch.manual_seed(0)
    model = GPT(cfg)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (m * rows, cfg.seq_len), generator=g)
    batch = {"input": x, "target": torch.roll(x, -1, dims=1)}

    def loss_fn(params, b):
        return ft.losses.cross_entropy(ft.apply(model, params, b["input"]), b["target"])

    return model, batch, loss_fn


# -- what each rank measures ---------------------------------------------------------------------


class SavedPeak:
    """The most bytes of tensors saved for backward alive at once (see the module docstring):
    ``with SavedPeak(state, batch) as s: step(state, batch)``, then ``s.peak``."""

    def __init__(self, state: ft.TrainState, batch: dict):
        kept = [*ft.tree.leaves(state.params), *batch.values()]  # not counted: they exist anyway
        self.skip = {t.untyped_storage().data_ptr() for t in kept}
        self.refs: dict[int, int] = {}
        self.live = self.peak = 0
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.skip or storage.nbytes() == 0:
            return t
        if self.refs.get(ptr, 0) == 0:
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[ptr] = self.refs.get(ptr, 0) + 1
        return _Saved(t, self, ptr, storage.nbytes())

    @staticmethod
    def _unpack(saved):
        return saved.t if isinstance(saved, _Saved) else saved

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


class _Saved:
    """One saved tensor; uncounted when autograd frees it."""

    def __init__(self, t, owner: SavedPeak, ptr: int, nbytes: int):
        self.t, self.owner, self.ptr, self.nbytes = t, owner, ptr, nbytes

    def __del__(self):
        refs = self.owner.refs
        refs[self.ptr] -= 1
        if refs[self.ptr] == 0:
            self.owner.live -= self.nbytes


class ChunkClock:
    """Times every chunk of compute one pipeline's stages run, and its ``schedule.step``, by
    wrapping those calls on torch's objects (this benchmark's own pipelines): ``events`` holds
    ``(kind, stage, micro-batch, seconds)`` in the order this rank ran them, kind ``F`` (forward),
    ``L`` (loss), ``B`` (whole backward), ``I`` / ``W`` (its input / weight halves); ``wall`` the
    seconds of ``schedule.step``. ``on`` switches recording (off for the warm-up)."""

    def __init__(self, pp, rows: int):
        self.events: list[tuple[str, int, int, float]] = []
        self.wall = 0.0
        self.on = False
        schedule = pp.runner.schedule
        # torch.distributed.pipelining keeps its stages in private attributes
        stages = getattr(schedule, "_stages", None) or [schedule._stage]
        last = max(s.stage_index for s in stages)
        for s in stages:
            i = s.stage_index
            s.forward_one_chunk = self._timed(s.forward_one_chunk, "F", i, lambda a, k: a[0])

            def backward(*a, full_backward=True, _f=s.backward_one_chunk, _i=i, **k):
                kind = "B" if full_backward else "I"
                return self._timed(_f, kind, _i, lambda a, k: a[0])(
                    *a, full_backward=full_backward, **k
                )

            s.backward_one_chunk = backward
            s.backward_weight_one_chunk = self._timed(
                s.backward_weight_one_chunk, "W", i, lambda a, k: a[0]
            )
        # the loss's target is the micro-batch's row numbers (ft.pipeline's runner)
        schedule._compute_loss = self._timed(
            schedule._compute_loss, "L", last, lambda a, k: int(a[1][0]) // rows
        )
        step = schedule.step

        def timed_step(*a, **k):
            t = time.perf_counter()
            out = step(*a, **k)
            if self.on:
                self.wall += time.perf_counter() - t
            return out

        schedule.step = timed_step

    def _timed(self, fn, kind: str, stage: int, micro):
        def call(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            if self.on:
                self.events.append((kind, stage, micro(a, k), time.perf_counter() - t))
            return out

        return call

    def take(self) -> tuple[float, list]:
        out = (self.wall, self.events)
        self.wall, self.events = 0.0, []
        return out


def _on_rank(cfg: GPTConfig, p: int, m: int, rows: int, rounds: int) -> dict:
    """Runs on each of the ``p`` processes: every schedule, its bytes, then interleaved rounds."""
    torch.set_num_threads(1)
    model, batch, loss_fn = _setup(cfg, m, rows)
    mesh = ft.distributed.pipeline.pp_mesh(pp=p)
    runs, out = {}, {}
    for name in VIRTUAL:
        pp = ft.pipeline(model, mesh, schedule=name, microbatches=m)
        opt = ft.optim.adamw(1e-3)
        step = pp(ft.train_step(loss_fn, opt))
        state = pp.shard_state(ft.TrainState.create(ft.params_of(model), opt))
        state, _ = step(state, batch)  # the first step: torch's shape inference
        with SavedPeak(state, batch) as saved:
            state, _ = step(state, batch)
        clock = ChunkClock(pp, rows)
        box = [state]

        def run(step=step, box=box):
            box[0], metrics = step(box[0], batch)
            float(metrics["loss"])

        runs[name] = (run, clock)
        out[name] = {
            "kept": local_bytes(state.params) + local_bytes(state.opt_state),
            "saved": saved.peak,
            "rounds": [],
        }
    names = list(runs)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            run, clock = runs[name]
            dist.barrier()
            clock.on = True
            t = time.perf_counter()
            run()
            step_s = time.perf_counter() - t
            clock.on = False
            wall, events = clock.take()
            out[name]["rounds"].append({"step": step_s, "wall": wall, "events": events})
    return out


def _one_process(cfg: GPTConfig, m: int, rows: int) -> dict:
    """pp = 1: the whole model on this process, the same micro-batches under ``ft.accumulate``."""
    torch.set_num_threads(1)
    model, batch, loss_fn = _setup(cfg, m, rows)
    opt = ft.optim.adamw(1e-3)
    step = ft.accumulate(ft.train_step(loss_fn, opt), m)
    state = ft.TrainState.create(ft.params_of(model), opt)
    state, _ = step(state, batch)
    with SavedPeak(state, batch) as saved:
        step(state, batch)
    return {"kept": local_bytes(state.params) + local_bytes(state.opt_state), "saved": saved.peak}


# -- the schedule replayed ------------------------------------------------------------------------


def replay(orders: list[list[tuple[str, int, int]]], cost: list[dict], last: int) -> list[float]:
    """Each rank's bubble when it runs ``orders[rank]`` (its chunks, in its order) with chunk
    ``(kind, stage)`` taking ``cost[rank][(kind, stage)]`` seconds, a chunk starting once its rank
    is free and its inputs exist, sends free (see the module docstring)."""
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * len(orders)
    busy = [0.0] * len(orders)
    at = [0] * len(orders)

    def needs(kind: str, stage: int, mb: int) -> list[tuple[str, int, int]]:
        if kind == "F":
            return [("F", stage - 1, mb)] if stage else []
        if kind == "L":
            return [("F", stage, mb)]
        if kind in ("B", "I"):
            return [("L", stage, mb)] if stage == last else [("G", stage + 1, mb)]
        return [("G", stage, mb)]  # W after the same chunk's input gradient

    while any(at[r] < len(o) for r, o in enumerate(orders)):
        moved = False
        for r, order in enumerate(orders):
            while at[r] < len(order):
                kind, stage, mb = order[at[r]]
                deps = needs(kind, stage, mb)
                if any(d not in done for d in deps):
                    break
                start = max([free[r], *(done[d] for d in deps)])
                free[r] = start + cost[r][kind, stage]
                busy[r] += cost[r][kind, stage]
                done["G" if kind in ("B", "I") else kind, stage, mb] = free[r]
                at[r] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"replay: the ranks' orders wait on each other: {orders}")
    end = max(free)
    return [1 - b / end for b in busy]


# a chunk's cost in the replay of equal stages: a backward twice a forward, each half once
UNIT = {"F": 1.0, "L": 0.0, "B": 2.0, "I": 1.0, "W": 1.0}


def summarize(results: list[dict], p: int, m: int) -> dict:
    """Per schedule: theory, the replayed and the wall bubble (mean over ranks), the step time
    (rank 0's median) and each rank's bytes."""
    out = {}
    for name in VIRTUAL:
        per_rank = [r[name] for r in results]
        n_rounds = len(per_rank[0]["rounds"])
        wall = [
            statistics.mean(
                1 - sum(e[3] for e in rk["rounds"][i]["events"]) / rk["rounds"][i]["wall"]
                for rk in per_rank
            )
            for i in range(n_rounds)
        ]
        cost, orders = [], []
        for rk in per_rank:
            times: dict[tuple[str, int], list[float]] = {}
            for rnd in rk["rounds"]:
                for kind, stage, _, s in rnd["events"]:
                    times.setdefault((kind, stage), []).append(s)
            cost.append({k: statistics.median(v) for k, v in times.items()})
            orders.append([e[:3] for e in rk["rounds"][-1]["events"]])
        last = VIRTUAL[name] * p - 1
        equal = [{k: UNIT[k[0]] for k in c} for c in cost]
        out[name] = {
            "theory": theory(name, p, m),
            "equal": statistics.mean(replay(orders, equal, last)),
            "replayed": statistics.mean(replay(orders, cost, last)),
            "wall": statistics.median(wall),
            "step": statistics.median(rnd["step"] for rnd in per_rank[0]["rounds"]),
            "kept": [rk["kept"] for rk in per_rank],
            "saved": [rk["saved"] for rk in per_rank],
        }
    # GPipe's first forward on rank 0 runs while every other rank waits; its later ones while
    # the next stage computes: how much one process slows another on this machine
    first = [e for rnd in results[0]["gpipe"]["rounds"] for e in rnd["events"] if e[0] == "F"]
    out["gpipe"]["alone"] = statistics.median(e[3] for e in first if e[2] == 0)
    out["gpipe"]["together"] = statistics.median(e[3] for e in first if e[2] > 0)
    return out


def _crosstalk(summary: dict) -> str:
    """What the wall column includes that the replays do not, with this run's numbers."""
    alone, together = summary["gpipe"]["alone"], summary["gpipe"]["together"]
    text = (
        f"Stage 0's forward of a micro-batch took {alone * 1e3:.0f} ms with the other ranks idle "
        f"(GPipe's first) and {together * 1e3:.0f} ms while the next stage computed (median of "
        "the others)"
    )
    if together > 1.2 * alone:
        return text + (
            ": the processes slow each other down, so a rank runs faster while its neighbours "
            "sit in the bubble, which hides part of the bubble from the wall column."
        )
    return text + (
        ": the processes barely slow each other down; the wall column's excess over the "
        "measured-cost replay is the sends and receives and the schedule's own Python between "
        "chunks, which the replay counts as free."
    )


def table(summary: dict, one: dict) -> list[str]:
    lines = [
        "| schedule | v | bubble: theory | replayed, equal stages | replayed, measured costs "
        "| wall | step ms | params + optimizer per rank / pp=1 "
        "| saved activations peak per rank / pp=1 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for name, s in summary.items():
        kept = " / ".join(f"{k / one['kept']:.2f}" for k in s["kept"])
        saved = " / ".join(f"{k / one['saved']:.2f}" for k in s["saved"])
        lines.append(
            f"| {name} | {VIRTUAL[name]} | {s['theory']:.3f} | {s['equal']:.3f} | {s['replayed']:.3f} "
            f"| {s['wall']:.3f} | {s['step'] * 1e3:.0f} | {kept} | {saved} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, pp = 2; write nothing")
    ap.add_argument("--pp", type=int, nargs="+", default=None, help="pipeline sizes (2 4)")
    ap.add_argument("--microbatches", type=int, default=None, help="default: 2 x pp")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if args.quick:
        cfg = GPTConfig(seq_len=16, d_model=32, n_layer=4, n_head=2, matmul="torch")
        sizes, rounds = args.pp or [2], 2
    else:
        cfg = GPTConfig(seq_len=128, d_model=256, n_layer=8, n_head=8, matmul="torch")
        sizes, rounds = args.pp or [2, 4], args.rounds
    rows = 1
    load = os.getloadavg()[0]
    from _common import machine

    body = []
    for p in sizes:
        m = args.microbatches or 2 * p
        one = _one_process(cfg, m, rows)
        results = run_distributed(_on_rank, p, cfg, p, m, rows, rounds, timeout=3600)
        summary = summarize(results, p, m)
        contended = " (more processes than cores: the wall column is contended)"
        body += [
            f"### pp = {p}, m = {m} micro-batches, {p} processes on {os.cpu_count()} cores"
            + (contended if p > (os.cpu_count() or 1) else ""),
            "",
            *table(summary, one),
            "",
            f"pp = 1 keeps {one['kept'] / (1 << 20):.1f} MiB of params + optimizer state and "
            f"saves at most {one['saved'] / (1 << 20):.1f} MiB of activations (one micro-batch "
            "of the whole model); per-rank columns list rank 0 / rank 1 / .... "
            + _crosstalk(summary),
            "",
        ]
    setup = (
        f"`python benchmarks/pipeline.py` on {machine()}; gloo, 1 torch thread per process. "
        f"GPT d={cfg.d_model}, {cfg.n_layer} blocks, seq {cfg.seq_len}, tied head, {rows} row per "
        f"micro-batch, AdamW; median of {rounds} interleaved rounds. Load average {load:.1f} at "
        f"the start and {os.getloadavg()[0]:.1f} at the end. Bubble: the idle fraction of a "
        "rank's pipeline time, mean over ranks; theory (p-1)/(v m+p-1) (Megatron-LM, "
        "Narayanan et al. 2021; for looped BFS and the zero-bubble schedules a reference); "
        "replayed: each rank's recorded order of chunks, sends free, with every stage equally "
        "costly (a backward twice a forward) or with their measured median times; wall: 1 - the "
        "time in its own stages' chunks / the time in schedule.step. Bytes of tensors per "
        "rank against one process: params + optimizer state kept between steps, and the peak of "
        "the tensors saved for backward (saved_tensors_hooks, params and batch not counted)."
    )
    text = "\n".join([setup, "", *body])
    print(text, flush=True)
    if not args.quick:
        from _common import write_section

        # benchmarks/pipeline_memory.py writes its part of the section: kept
        write_section(SECTION, text, keep=("ft.memory of a pipelined step",))


if __name__ == "__main__":
    main()
