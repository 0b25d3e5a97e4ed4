"""benchmarks/gpu.py's dry run on the CPU (``--device cpu --tiny --no-compile``): every check and
every part of the bench runs end to end and passes, and the GPU section it writes holds them.
On a CUDA machine the same script runs at full size (it is not run here)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_benchmark_dry_run_on_the_cpu(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\n## Other\n\nkept\n")
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu.py", "--device", "cpu", "--tiny", "--no-compile",
         "--results", str(results)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAIL" not in proc.stdout
    text = results.read_text()
    assert "## Other\n\nkept" in text and "## GPU\n" in text
    section = text.split("## GPU\n", 1)[1]
    for check in ("accumulate(4) vs whole batch", "checkpoint selective vs plain",
                  "autocast fp16 vs fp32", "offload optimizer+gradients vs on the device",
                  "shard fsdp over gloo, 2 process(es)",
                  "load back (like=)", "data.loader(device='cpu')", "ft.memory peak, bf16 + blocks",
                  "ftrain's first loss vs the PyTorch loop's"):  # fmt: skip
        row = next(line for line in section.splitlines() if check in line)
        assert row.endswith("| pass |"), row
    for side in ("ftrain (donated step)", "PyTorch loop", "ftrain, loss in bf16 as the loop's"):
        assert f"| eager | {side} |" in section
    assert "torch.optim.AdamW(fused=True)" in section and "update_and_apply" in section
    assert section.count("### Kernels of one eager step") == 3  # one per eager side
