"""Optimizer-state bytes of a LoRA run against full fine-tuning, for ``ftrain train``'s GPT.

    python benchmarks/lora.py

The model and optimizer are the CLI's defaults (``ftrain.app.recipes.gpt``); the state is built as
the CLI builds it (``gpt.build_state``), with and without ``--lora-rank``. Bytes are counted by
``ftrain.optim.state_bytes``, so they are exact, not timed. Writes the ``LoRA`` section of
RESULTS.md.
"""

from __future__ import annotations

from _common import machine, write_section

from ftrain.app.config import TrainConfig
from ftrain.app.recipes import gpt
from ftrain.optim import state_bytes

SETTINGS = [  # (rank, targets)
    (8, "all-linear"),
    (8, "attn.qkv,attn.proj"),
    (4, "attn.qkv,attn.proj"),
]


def opt_state_bytes(cfg: TrainConfig) -> int:
    model = gpt.build_model(cfg)
    return state_bytes(gpt.build_state(cfg, model, gpt.build_optimizer(cfg)).opt_state)


def main() -> None:
    full = opt_state_bytes(TrainConfig())
    rows = [f"| full fine-tuning | {full:,} | 1.000 |"]
    for rank, targets in SETTINGS:
        n = opt_state_bytes(TrainConfig(lora_rank=rank, lora_targets=targets))
        rows.append(f"| LoRA rank {rank} on `{targets}` | {n:,} | {n / full:.3f} |")
    body = "\n".join(
        [
            f"`python benchmarks/lora.py` on {machine()}.",
            "AdamW state of `ftrain train`'s default GPT, built as the CLI builds it; bytes from "
            "`ftrain.optim.state_bytes` (exact).",
            "",
            "| run | optimizer state bytes | / full |",
            "| --- | ---: | ---: |",
            *rows,
        ]
    )
    print(body)
    write_section("LoRA optimizer state", body)


if __name__ == "__main__":
    main()
