"""Shared by the benchmark scripts: interleaved timing, machine facts, RESULTS.md sections."""

from __future__ import annotations

import datetime
import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ftrain.app.process import keep_freed_memory

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
# As `ftrain train` does for its process: freed activations stay in the heap instead of being
# faulted in again every step (both sides of every comparison run in this process).
KEEPS_FREED_MEMORY = keep_freed_memory()


def machine() -> str:
    """One line: CPU model, cores, torch threads, torch version, GPU if any, date."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    malloc = ", malloc keeps freed memory (as `ftrain train`)" if KEEPS_FREED_MEMORY else ""
    return (
        f"{cpu} ({os.cpu_count()} cores), {torch.get_num_threads()} torch threads, {gpu}, "
        f"torch {torch.__version__}{malloc}, {datetime.date.today().isoformat()}"
    )


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 2) -> dict:
    """Median seconds per call of each function, timed in alternation (A B A B ...) so that a
    change in machine load hits all of them alike."""
    for _ in range(warmup):
        for f in fns.values():
            f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def rounds(fns: dict[str, Callable[[], None]], n_rounds: int) -> dict[str, dict]:
    """Median wall and CPU seconds per call of each function over ``n_rounds`` rounds, each
    round one call of every function, the order rotating from round to round (A B C, B C A, ...):
    a change in machine load lands on all of them alike."""
    for f in fns.values():  # warm-up: first-call allocations, lazy inits
        f()
        f()
    names = list(fns)
    wall: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}
    for r in range(n_rounds):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            w, c = time.perf_counter(), time.process_time()
            fns[k]()
            cpu[k].append(time.process_time() - c)
            wall[k].append(time.perf_counter() - w)
    return {
        k: {"wall": statistics.median(wall[k]), "cpu": statistics.median(cpu[k])} for k in names
    }


TOTAL, OUTSIDE = "**step total**", "(outside any op: Python, dispatch)"


def profile_diff(
    before: Callable[[], object], after: Callable[[], object], steps: int, top: int, chunk: int = 1
) -> tuple[list[str], dict[str, float]]:
    """Self CPU µs per call of each op (torch.profiler) of ``after`` against ``before``: table
    rows (the whole call, the time outside any op, then the ``top`` ops where the two differ
    most), and ``before``'s µs per key. The two are profiled ``chunk`` calls at a time,
    alternating, ``steps`` calls each; the profiler's own cost per op inflates both totals, so
    read the differences."""
    from torch.profiler import ProfilerActivity, profile, record_function

    per_op: tuple[dict[str, float], dict[str, float]] = ({}, {})
    for fn in (before, after):  # warm-up
        fn(), fn()
    for _ in range(steps // chunk):
        for fn, acc in zip((before, after), per_op):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(chunk):
                    with record_function("## step ##"):
                        fn()
            for e in prof.key_averages():
                whole = e.key == "## step ##"
                us = (e.cpu_time_total if whole else e.self_cpu_time_total) / steps
                key = TOTAL if whole else f"`{e.key}`"
                acc[key] = acc.get(key, 0.0) + us
    for acc in per_op:
        acc[OUTSIDE] = 2 * acc[TOTAL] - sum(acc.values())  # the call less every op in it
    a, b = per_op
    diff = {k: b.get(k, 0.0) - a.get(k, 0.0) for k in a.keys() | b.keys()}
    ranked = sorted((k for k in diff if k not in (TOTAL, OUTSIDE)), key=lambda k: -abs(diff[k]))
    keys = [TOTAL, OUTSIDE, *ranked[:top]]
    rows = [f"| {k} | {a.get(k, 0.0):.0f} | {b.get(k, 0.0):.0f} | {diff[k]:+.0f} |" for k in keys]
    print("\n".join(rows), flush=True)
    return rows, a


def _part(level: int, title: str) -> re.Pattern:
    """A heading of ``level`` (2: ``##``) named ``title`` and what follows it, up to the next
    heading of that level or above."""
    stop = "|".join("#" * n + " " for n in range(2, level + 1))
    return re.compile(rf"^{'#' * level} {re.escape(title)}\n.*?(?=^(?:{stop})|\Z)", re.S | re.M)


def write_section(title: str, body: str, keep: tuple[str, ...] = ()) -> None:
    """Replace (or append) the ``## title`` section of RESULTS.md with ``body``, carrying over
    the ``### `` subsections of it named in ``keep`` (another script's: :func:`write_subsection`)."""
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    section = f"## {title}\n\n{body.strip()}\n"
    old = _part(2, title).search(text)
    for sub in keep:
        kept = _part(3, sub).search(old.group(0)) if old else None
        if kept:
            section += "\n" + kept.group(0).strip() + "\n"
    if old:
        text = text[: old.start()] + section + "\n" + text[old.end() :]
    else:
        text = text.rstrip() + "\n\n" + section
    RESULTS.write_text(text.rstrip() + "\n")


def write_subsection(section: str, title: str, body: str) -> None:
    """Replace (or append at the end of) the ``### title`` part of RESULTS.md's ``## section``
    with ``body``, the rest of the section as it is."""
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    part = f"### {title}\n\n{body.strip()}\n"
    found = _part(2, section).search(text)
    if found is None:
        write_section(section, part)
        return
    whole = found.group(0).rstrip() + "\n"
    sub = _part(3, title).search(whole)
    whole = whole[: sub.start()] + part + "\n" + whole[sub.end() :] if sub else whole + "\n" + part
    text = text[: found.start()] + whole.rstrip() + "\n\n" + text[found.end() :]
    RESULTS.write_text(text.rstrip() + "\n")
