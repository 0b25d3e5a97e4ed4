"""Fine-tuning runs that travel: the model folder's identity, the chat template, LoRA checkpoints
without the frozen base, and sampling a chat reply.

    ftrain train --model-dir M --data chats.jsonl --lora-rank 8 --out runs/a
    ls runs/a      # model.json (M's absolute path, sha256 of its weights), chat_template.jinja
    ftrain sample --run runs/a --chat "What is 2 + 2?"         # the template, up to end of turn
    ftrain sample --run runs/a --model-dir /elsewhere/M         # the folder moved: checked

A run's folder records what it was trained from, beside ``config.json``:

    model.json            {"model_dir": absolute path, "weights_sha256": {file: sha256}}
                          (``--model-dir`` runs): ``sample`` and ``export`` find the folder from
                          anywhere, and a LoRA run refuses another base (its adapters belong to
                          these weights), on ``--resume`` as with ``--model-dir`` elsewhere
    chat_template.jinja   the template the chats were rendered with (``--chat-template``, the
                          model's, or the built-in one for chat data on the byte tokenizer):
                          what ``sample --chat`` renders with and every export writes

A LoRA checkpoint holds the adapters, the optimizer's state and the rest of the state, not the
base (``ftrain.transforms.lora.split_base``): whoever loads it puts the model's weights back.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, NamedTuple

import torch

import ftrain as ft
from ftrain import data
from ftrain.app.config import TrainConfig
from ftrain.app.recipes import gpt, hf
from ftrain.data.build import read_meta
from ftrain.models.hf import weights_sha256
from ftrain.transforms.lora import join_base, split_base

__all__ = [
    "DEFAULT_CHAT",
    "MODEL_FILE",
    "TEMPLATE_FILE",
    "LoadedRun",
    "chat_reply",
    "checkpoint_like",
    "end_sample",
    "load_run",
    "record_run",
    "run_template",
    "sample",
]

MODEL_FILE = "model.json"
TEMPLATE_FILE = "chat_template.jinja"
DEFAULT_CHAT = "Hello! What can you do?"  # `ftrain sample` on a chat model without a prompt


# -- recording a run ---------------------------------------------------------------------------
def record_run(out: Path, cfg: TrainConfig) -> None:
    """Write ``out/model.json`` (a ``--model-dir`` run) and ``out/chat_template.jinja`` (a run
    with a template, :func:`run_template`); on ``--resume``, first check that the model folder
    holds the weights the run started from. Main process, before the first step.

    Raises:
        SystemExit: a LoRA run resumed on other base weights (its adapters belong to the old
            ones); the message names the files that differ and the folder it trained from.
    """
    if cfg.model_dir:
        identity = {
            "model_dir": str(Path(cfg.model_dir).resolve()),
            "weights_sha256": weights_sha256(cfg.model_dir),
        }
        recorded = _read_json(out / MODEL_FILE)
        if cfg.resume and recorded is not None:
            _check_same_weights(recorded, identity, bool(cfg.lora_rank), "ftrain train --resume")
        (out / MODEL_FILE).write_text(json.dumps(identity, indent=2) + "\n")
    template = run_template(cfg)
    if template is not None:
        (out / TEMPLATE_FILE).write_text(template)


def run_template(cfg: TrainConfig) -> str | None:
    """The chat template of a run: ``--chat-template``'s, else the model folder's, else for
    data with a loss mask (chats) on the byte tokenizer the built-in one; None otherwise."""
    tokenizer = data.load_tokenizer(cfg.model_dir) if cfg.model_dir else data.ByteTokenizer()
    if cfg.chat_template:
        return data.template_of(data.with_chat_template(tokenizer, cfg.chat_template))
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.chat_template
    meta = read_meta(gpt.data_dir(cfg)) or {}
    if meta.get("masked") and not hasattr(tokenizer, "chat_template"):
        return data.BUILTIN_CHAT_TEMPLATE
    return None


def checkpoint_like(state: ft.TrainState, meta: dict) -> tuple[ft.TrainState, Any]:
    """What to load a checkpoint (``meta``: its ``ft.load_meta``) against, and the frozen LoRA
    base to put back after (``join_base``): a LoRA checkpoint holds no base, so ``state``
    without it; one written with the base (an older ftrain's) is loaded whole (base None)."""
    saved = meta["tree"].get("extra", {}).get("lora", {})
    return (state, None) if "base" in saved else split_base(state)


def _check_same_weights(recorded: dict, identity: dict, lora: bool, command: str) -> None:
    """Refuse (LoRA) or note (full fine-tuning: the checkpoint holds every weight, the folder
    gives only the config and tokenizer) a model folder whose weights are not the run's."""
    then, now = recorded.get("weights_sha256", {}), identity["weights_sha256"]
    if then == now:
        return
    differ = sorted(k for k in {*then, *now} if then.get(k) != now.get(k))
    what = (
        f"{command}: the weights in {identity['model_dir']} are not those the run was trained "
        f"from ({recorded.get('model_dir')}): {', '.join(differ[:4])} differ (sha256)"
    )
    if lora:
        raise SystemExit(
            f"{what}. A LoRA run's adapters belong to its base: pass --model-dir with the "
            "folder it was trained from"
        )
    print(f"{what}; the checkpoint holds every weight, so only the folder's config and "
          "tokenizer are read from it", file=sys.stderr)  # fmt: skip


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


# -- loading a run -----------------------------------------------------------------------------
class LoadedRun(NamedTuple):
    """A run's newest checkpoint, ready to sample or export (:func:`load_run`)."""

    cfg: TrainConfig  # the run's settings, model_dir resolved to the folder used
    state: ft.TrainState  # whole tensors; a LoRA run's with its base put back
    model: torch.nn.Module  # the template (float32), as the run trained it
    params: Any  # what the run evaluates with: LoRA merged, schedule-free averaged
    tokenizer: Any  # the model folder's, or ByteTokenizer
    template: str | None  # the run's chat template (chat_template.jinja), else the tokenizer's


def load_run(run: str | Path, *, model_dir: str | None = None, command: str) -> LoadedRun:
    """The newest valid checkpoint of the run folder ``run`` (or the checkpoint folder ``run``)
    with its model. The model folder is ``model_dir`` when given (checked against the run's
    ``model.json``), else the absolute path recorded there, else ``--model-dir`` as saved.

    Raises:
        SystemExit: no checkpoint, no model folder to be found (the message names
            ``--model-dir``), or a LoRA run's base whose weights changed (sha256).
    """
    latest, cfg = gpt.run_config(run, command)
    folder = Path(run) if not (Path(run) / "meta.json").exists() else Path(run).parent
    meta = ft.load_meta(latest)
    lora = "lora" in meta["tree"].get("extra", {})
    if cfg.model_dir or model_dir:
        found = _model_dir(folder, cfg, model_dir, lora, command)
        cfg = dataclasses.replace(cfg, model_dir=found)
    tokenizer = data.load_tokenizer(cfg.model_dir) if cfg.model_dir else data.ByteTokenizer()
    model = hf.build_model(cfg, tokenizer) if cfg.model_dir else gpt.build_model(cfg)
    state = ft.load(latest)
    if lora and "base" not in state.extra["lora"].keys():  # adapters only: the model's weights
        state = join_base(state, ft.params_of(model))
    template = (folder / TEMPLATE_FILE).read_text() if (folder / TEMPLATE_FILE).is_file() else None
    template = template or getattr(tokenizer, "chat_template", None)
    return LoadedRun(cfg, state, model, gpt.eval_params(cfg, state), tokenizer, template)


def _model_dir(folder: Path, cfg: TrainConfig, given: str | None, lora: bool, command: str) -> str:
    recorded = _read_json(folder / MODEL_FILE) or {}
    candidates = [given] if given else [recorded.get("model_dir"), cfg.model_dir]
    found = next((c for c in candidates if c and Path(c).is_dir()), None)
    if found is None:
        raise SystemExit(
            f"{command}: the run's model folder ({given or recorded.get('model_dir') or cfg.model_dir}"
            f") is not a directory here; pass --model-dir DIR with the folder it was trained from "
            "(its weights are checked against the run's sha256)"
        )
    if recorded and (given or lora):  # another folder, or a base the adapters depend on
        identity = {
            "model_dir": str(Path(found).resolve()),
            "weights_sha256": weights_sha256(found),
        }
        _check_same_weights(recorded, identity, lora, command)
    return str(found)


# -- sampling ----------------------------------------------------------------------------------
def sample(
    run: str | Path,
    prompt: str | None = None,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
    *,
    chat: str | None = None,
    model_dir: str | None = None,
) -> str:
    """``ftrain sample``: ``prompt`` continued by the run's model, or with ``chat`` the reply to
    that user message (:func:`chat_reply`). With neither, a chat model (a run with a chat
    template) answers :data:`DEFAULT_CHAT` and any other continues ``"def "``."""
    loaded = load_run(run, model_dir=model_dir, command="ftrain sample")
    if chat is None and prompt is None and loaded.template:
        chat = DEFAULT_CHAT
    if chat is not None:
        return chat_reply(loaded, chat, max_new_tokens, temperature=temperature, top_k=top_k,
                          seed=seed)  # fmt: skip
    recipe = hf if loaded.cfg.model_dir else gpt
    return recipe.sample_text(loaded.model, loaded.params, "def " if prompt is None else prompt,
                              max_new_tokens, temperature=temperature, top_k=top_k, seed=seed)  # fmt: skip


def end_sample(out: Path, cfg: TrainConfig, model: torch.nn.Module, params) -> str:
    """The sample at the end of a run (``cfg.sample_tokens`` tokens, seeded by ``cfg.seed``): on a
    chat model (the run wrote ``chat_template.jinja``) :data:`DEFAULT_CHAT` and the reply to it,
    else ``"def "`` continued. ``model`` is not changed."""
    if not (out / TEMPLATE_FILE).is_file():
        recipe = hf if cfg.model_dir else gpt
        return recipe.sample_text(model, params, "def ", cfg.sample_tokens, seed=cfg.seed)
    tokenizer = data.load_tokenizer(cfg.model_dir) if cfg.model_dir else data.ByteTokenizer()
    loaded = LoadedRun(cfg, None, model, params, tokenizer, (out / TEMPLATE_FILE).read_text())
    reply = chat_reply(loaded, DEFAULT_CHAT, cfg.sample_tokens, seed=cfg.seed)
    return f"user: {DEFAULT_CHAT}\nassistant: {reply}"


def chat_reply(
    loaded: LoadedRun,
    message: str,
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
) -> str:
    """The model's reply to the user ``message``: the conversation rendered with the run's
    template and its generation prompt, then tokens sampled until the template's end of turn
    (``ftrain.data.end_of_turn``) or the end-of-document token, at most ``max_new_tokens``.
    Returns the reply's text, without the end-of-turn marker."""
    template = loaded.template or data.template_of(loaded.tokenizer)
    tok = data.TemplatedTokenizer(loaded.tokenizer, template)
    turn = [{"role": "user", "content": message}]
    ids = tok.encode(data.render_chat(tok, turn, add_generation_prompt=True))
    stops = [s for s in (tok.encode(data.end_of_turn(tok)), [tok.eot_id]) if s]
    seq_len = hf.context_length(loaded.model) if loaded.cfg.model_dir else None
    # on the params' device, through ft.apply: the run's template may hold no params of its own
    out = gpt.generate_from(loaded.model, loaded.params, torch.tensor([ids]), max_new_tokens,
                            temperature=temperature, top_k=top_k, seed=seed, seq_len=seq_len,
                            stop_sequences=stops)[0, len(ids):].tolist()  # fmt: skip
    ends = [i for s in stops for i in range(len(out)) if out[i : i + len(s)] == s]
    return tok.decode(out[: min(ends, default=len(out))])
