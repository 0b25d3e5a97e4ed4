"""The ``ftrain`` command: ``train``, ``sample``, ``consolidate`` and ``export``.

    ftrain train --help                           # every setting of ftrain.app.config.TrainConfig
    ftrain train --out runs/a                     # ftrain.app.loop.train with the built-in recipe
    ftrain sample --run runs/a --prompt "def "    # ftrain.app.recipes.sample (--chat "...": a
    reply) ftrain consolidate --run runs/a --out export/  # ft.consolidate: whole-tensor params
    ftrain export --run runs/a --out hf/a         # ftrain.app.export.export_run: a Hugging Face dir
    ftrain export --run runs/l --out ad --adapter  # a LoRA run's adapters as a PEFT folder

Bad flags get argparse's usage message and exit code 2, never a traceback; a damaged checkpoint
gets its message and exit code 1; a run stopped by Ctrl-C (its checkpoint saved) exits with 130.
"""

from __future__ import annotations

import argparse
import sys

import ftrain as ft
from ftrain.app.config import add_arguments, from_args

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    """The command-line parser (``ftrain --help``)."""
    return _parsers()[0]


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The command-line parser and its ``train`` subparser (whose ``error`` reports a bad
    setting as ``ftrain train: error: ...``, under that command's usage)."""
    p = argparse.ArgumentParser(
        prog="ftrain", description="Functional training for PyTorch: the main job and tools."
    )
    sub = p.add_subparsers(
        dest="command", required=True, metavar="{train,sample,consolidate,export}"
    )
    t = sub.add_parser(
        "train",
        help="train a byte-level GPT on the Python standard library",
        description="Train a byte-level GPT on the built-in corpus (the Python standard library), "
        "or your Hugging Face model (--model-dir) on your data (--data). "
        "Every setting is a flag and a key of --config FILE.toml; flags win.",
    )
    add_arguments(t)
    s = sub.add_parser("sample", help="generate text from a run's newest checkpoint")
    s.add_argument("--run", required=True, metavar="DIR", help="run directory or checkpoint")
    s.add_argument(
        "--prompt", help="text to continue (default: 'def ', or on a chat model a --chat turn)"
    )
    s.add_argument("--chat", metavar="MESSAGE", help="reply to this user message (chat template)")
    s.add_argument("--model-dir", metavar="DIR", help="the run's model folder, if it moved")
    s.add_argument("--max-new-tokens", type=int, default=200, metavar="N")
    s.add_argument("--temperature", type=float, default=0.8, metavar="T")
    s.add_argument("--top-k", type=int, default=50, metavar="K", help="0 = no top-k filter")
    s.add_argument("--seed", type=int, default=0)
    c = sub.add_parser(
        "consolidate",
        help="whole-tensor params of a checkpoint, in Hugging Face's (sharded) layout",
        description="Write the params of a checkpoint (whole or sharded, by any number of "
        "processes) as whole tensors: OUT/model.safetensors, or past --max-shard-size "
        "model-0000k-of-0000n.safetensors + model.safetensors.index.json.",
    )
    c.add_argument("--run", required=True, metavar="PATH", help="run directory or checkpoint")
    c.add_argument("--out", required=True, metavar="DIR", help="directory to write")
    c.add_argument("--max-shard-size", default="5GB", metavar="SIZE", help="default: 5GB")
    e = sub.add_parser(
        "export",
        help="write a run's model as a Hugging Face directory (config, safetensors, tokenizer)",
    )
    e.add_argument("--run", required=True, metavar="DIR", help="run directory or checkpoint")
    e.add_argument("--out", required=True, metavar="DIR", help="the directory to write")
    e.add_argument("--adapter", action="store_true", help="a LoRA run's PEFT adapter folder")
    e.add_argument("--model-dir", metavar="DIR", help="the run's model folder, if it moved")
    return p, t


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit status (130 after a Ctrl-C that saved a checkpoint)."""
    p, train_parser = _parsers()
    ns = p.parse_args(argv)
    if ns.command == "train":
        from ftrain.app.loop import train
        from ftrain.app.process import keep_freed_memory
        from ftrain.app.run_folder import check_out

        try:
            cfg = from_args(ns)
            check_out(cfg)
        except ValueError as e:
            train_parser.error(str(e))

        keep_freed_memory()  # this process trains: no page faults on every step's activations
        try:
            summary = train(cfg)
        except ft.CheckpointError as e:  # a damaged checkpoint: its message says which and why
            print(f"ftrain train: {e}", file=sys.stderr)
            return 1
        except ft.data.DataError as e:  # data that would train nothing: refused before step 1
            train_parser.error(str(e))
        return 130 if summary.get("interrupted") else 0
    if ns.command == "sample":
        if ns.max_new_tokens < 1 or ns.temperature < 0 or ns.top_k < 0:
            p.error("sample: --max-new-tokens >= 1, --temperature >= 0 and --top-k >= 0")
        if ns.chat is not None and ns.prompt is not None:
            p.error("sample: give --prompt (text to continue) or --chat (a message to answer)")
        from ftrain.app.recipes import sample

        try:
            text = sample(ns.run, ns.prompt, ns.max_new_tokens, ns.temperature, ns.top_k or None,
                          ns.seed, chat=ns.chat, model_dir=ns.model_dir)  # fmt: skip
        except ft.CheckpointError as e:
            print(f"ftrain sample: {e}", file=sys.stderr)
            return 1
        print(text)
        return 0
    if ns.command == "consolidate":
        try:
            files = ft.consolidate(ns.run, ns.out, max_shard_size=ns.max_shard_size)
        except ValueError as e:
            p.error(f"consolidate: {e}")
        except ft.CheckpointError as e:
            print(f"ftrain consolidate: {e}", file=sys.stderr)
            return 1
        print(f"ftrain consolidate: wrote {', '.join(f.name for f in files)} to {ns.out}")
        return 0
    if ns.command == "export":
        from ftrain.app.export import export_run

        try:
            out = export_run(ns.run, ns.out, adapter=ns.adapter, model_dir=ns.model_dir)
        except ft.CheckpointError as e:
            print(f"ftrain export: {e}", file=sys.stderr)
            return 1
        how = "peft.PeftModel.from_pretrained(base, {!r})" if ns.adapter else (
            "AutoModelForCausalLM.from_pretrained({!r})")  # fmt: skip
        print(f"ftrain export: wrote {out} ({how.format(str(out))})")
        return 0
    return 2  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
