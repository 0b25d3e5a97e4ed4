"""Run every benchmark; each rewrites its own section of benchmarks/RESULTS.md.

    python benchmarks/run_all.py            # all of them (about 25 minutes on a 2-core CPU)
    python benchmarks/run_all.py mfu data   # some of them

Each script measures ftrain and the imperative PyTorch way side by side in the same run and
reports ratios; the header of RESULTS.md records the machine and the date of this run.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from _common import RESULTS, machine

HERE = Path(__file__).resolve().parent
SCRIPTS = ["step_overhead", "transforms", "data", "optimizers", "mfu", "shard", "vmap",
           "checkpoint", "memory", "lora", "born", "offload", "offload_plan", "pipeline",
           "compile_memory"]  # fmt: skip


def main(names: list[str]) -> int:
    names = names or SCRIPTS
    unknown = [n for n in names if n not in SCRIPTS]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; choose from {SCRIPTS}", file=sys.stderr)
        return 2
    failed = []
    for name in names:
        path = HERE / f"{name}.py"
        if not path.exists():
            print(f"== {name}: missing, skipped")
            continue
        print(f"== {name}", flush=True)
        t = time.perf_counter()
        rc = subprocess.call([sys.executable, str(path)], cwd=HERE)
        print(f"== {name}: exit {rc} in {time.perf_counter() - t:.0f} s", flush=True)
        if rc:
            failed.append(name)
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    body = text.split("\n## ", 1)
    header = (
        "# Benchmark results\n\nLatest full run of `python benchmarks/run_all.py`: "
        f"{machine()}. Each section names the script that wrote it and the machine it ran on.\n"
    )
    RESULTS.write_text(header + ("\n## " + body[1] if len(body) > 1 else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
