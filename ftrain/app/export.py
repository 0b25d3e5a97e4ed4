"""``ftrain export``: a run's model as a Hugging Face directory (config, safetensors, tokenizer).

    ftrain export --run runs/a --out hf/a
    python -c "from transformers import AutoModelForCausalLM as M; M.from_pretrained('hf/a')"

The built-in GPT is written as a GPT-2 model (``GPT2LMHeadModel``): the two are the same network
(pre-norm blocks, learned positions, exact GELU, 1/sqrt(head size) attention, LayerNorm with the
run's epsilon, the head tied to the token embedding or not), so the mapping is exact: fused qkv
and every linear transposed into GPT-2's ``Conv1D`` layout, zero biases where the run has none.
A mixture-of-experts GPT has no GPT-2 counterpart and is refused. Its byte tokenizer is written
as a ``tokenizers`` byte-level BPE with no merges: ids 0..255 are the UTF-8 bytes and 256 is
``<|endoftext|>``, so ``AutoTokenizer`` encodes and decodes as ``ByteTokenizer`` does.

A Hugging Face model (a ``--model-dir`` run) is written with its own ``save_pretrained``, in the
dtype its folder stores (a bf16 model stays bf16) and with the folder's ``use_cache``. A LoRA
run's adapters are folded into the weights first (``ft.merge_lora``), so the directory holds a
plain model; or, with ``--adapter``, the adapters alone as a PEFT folder (:func:`export_peft`)::

    ftrain export --run runs/l --out ad --adapter
    peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(M), "ad")

Every export carries the run's chat template (``tokenizer_config.json``'s ``chat_template``), so
``tokenizer.apply_chat_template`` renders chats as the run was trained on them. Needs
``transformers`` (``pip install 'ftrain[hf]'``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import nn

import ftrain as ft
from ftrain import tree
from ftrain.models import GPT

__all__ = [
    "export_hf",
    "export_peft",
    "export_gpt",
    "gpt2_config",
    "gpt2_state_dict",
    "byte_tokenizer",
    "export_run",
]

EOT = "<|endoftext|>"  # the byte tokenizer's id 256, under GPT-2's name for it


def export_hf(model: nn.Module, params: TensorDictBase, out: str | Path) -> Path:
    """``out`` as ``model.save_pretrained`` writes it (``config.json``, ``model.safetensors``),
    with the weights ``params`` (whole tensors, e.g. ``ft.merge_lora(state)``). ``model`` is a
    Hugging Face ``PreTrainedModel`` template and is not changed; tied weights, given once in
    ``params`` as ``ft.params_of`` gives them, stay tied."""
    if not hasattr(model, "save_pretrained"):
        raise TypeError(
            f"export_hf(model, ...): model must be a Hugging Face PreTrainedModel (it writes "
            f"itself with save_pretrained), got {type(model).__name__}; for ftrain's GPT use "
            "export_gpt."
        )
    copied = copy.deepcopy(model)
    result = copied.load_state_dict(ft.state_dict_of(params), strict=False)
    owned = {k for k, _ in model.named_parameters()}  # tied weights appear once
    missing = sorted(set(result.missing_keys) & owned)
    if missing or result.unexpected_keys:
        unexpected = sorted(result.unexpected_keys)
        raise KeyError(
            f"export_hf: params do not match {type(model).__name__}: {len(missing)} missing "
            f"{missing[:3]}, {len(unexpected)} unexpected {unexpected[:3]}; give the model's "
            "whole params (ft.merge_lora(state) for a LoRA run)."
        )
    out = Path(out)
    copied.save_pretrained(out, safe_serialization=True)
    return out


def gpt2_config(model: GPT) -> Any:
    """The ``transformers.GPT2Config`` of the same network as ``model`` (a ftrain ``GPT``)."""
    from transformers import GPT2Config

    c = model.config
    if c.n_experts:
        raise ValueError(
            f"export: a mixture-of-experts GPT (n_experts={c.n_experts}) has no GPT-2 "
            "counterpart; export a dense model (n_experts=0)."
        )
    return GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=c.seq_len,
        n_embd=c.d_model,
        n_layer=c.n_layer,
        n_head=c.n_head,
        n_inner=c.ff_dim,
        activation_function="gelu",  # exact (erf) GELU, as F.gelu; GPT-2's own is tanh's
        layer_norm_epsilon=c.norm_eps,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=c.tie_weights,
        bos_token_id=c.vocab_size - 1,
        eos_token_id=c.vocab_size - 1,
    )


def gpt2_state_dict(model: GPT, params: TensorDictBase) -> dict[str, torch.Tensor]:
    """``params`` of the ftrain ``GPT`` ``model`` under ``GPT2LMHeadModel``'s names and layouts:
    linear weights transposed into ``Conv1D``'s ``(in, out)``, zero biases where ``model`` has
    none (GPT-2 always has them), the head tied or its own."""
    p = {k: v.detach() for k, v in tree.to_flat(params).items()}
    c = model.config

    def bias(key: str, size: int) -> torch.Tensor:
        return p[key] if key in p else torch.zeros(size, dtype=p["wte.weight"].dtype)

    sd = {"transformer.wte.weight": p["wte.weight"], "transformer.wpe.weight": p["wpe.weight"]}
    d, ff = c.d_model, c.ff_dim
    for i in range(c.n_layer):
        ours, theirs = f"blocks.{i}", f"transformer.h.{i}"
        for name, size in (("ln_1", d), ("ln_2", d)):
            sd[f"{theirs}.{name}.weight"] = p[f"{ours}.{name}.weight"]
            sd[f"{theirs}.{name}.bias"] = bias(f"{ours}.{name}.bias", size)
        for src, dst, size in (
            ("attn.qkv", "attn.c_attn", 3 * d),  # q, k, v side by side, heads "(nh hs)" in both
            ("attn.proj", "attn.c_proj", d),
            ("mlp.fc", "mlp.c_fc", ff),
            ("mlp.proj", "mlp.c_proj", d),
        ):
            sd[f"{theirs}.{dst}.weight"] = p[f"{ours}.{src}.weight"].T.contiguous()  # (in, out)
            sd[f"{theirs}.{dst}.bias"] = bias(f"{ours}.{src}.bias", size)
    sd["transformer.ln_f.weight"] = p["ln_f.weight"]
    sd["transformer.ln_f.bias"] = bias("ln_f.bias", d)
    sd["lm_head.weight"] = p["wte.weight"] if c.tie_weights else p["lm_head.weight"]
    return sd


def export_gpt(model: GPT, params: TensorDictBase, out: str | Path) -> Path:
    """``out`` holding ``model`` with ``params`` as a GPT-2 model (``config.json``,
    ``model.safetensors``) and the byte tokenizer (:func:`byte_tokenizer`):
    ``AutoModelForCausalLM.from_pretrained(out)`` gives ftrain's logits (fp32: 1e-5)."""
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel(gpt2_config(model))
    result = hf.load_state_dict(gpt2_state_dict(model, params), strict=False)
    if result.unexpected_keys or [k for k in result.missing_keys if not k.endswith("attn.bias")]:
        raise KeyError(f"export_gpt: unmapped weights {result}")  # a bug: every key is mapped
    out = Path(out)
    hf.save_pretrained(out, safe_serialization=True)
    byte_tokenizer(model.config.vocab_size).save_pretrained(out)
    return out


def byte_tokenizer(vocab_size: int = 257) -> Any:
    """``ByteTokenizer`` as a ``transformers`` fast tokenizer: a byte-level BPE without merges, so
    each UTF-8 byte is one token whose id is the byte's value; ``<|endoftext|>`` is id 256 (the
    end-of-document token), also its BOS, EOS and padding token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size != 257:
        raise ValueError(f"byte_tokenizer(vocab_size={vocab_size}): the byte vocabulary is 257.")
    vocab = {char: byte for byte, char in _byte_chars().items()}
    vocab[EOT] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOT, eos_token=EOT, pad_token=EOT, unk_token=None
    )


def _byte_chars() -> dict[int, str]:
    """Byte-level BPE's alphabet: the printable Latin-1 bytes stand for themselves, every other
    byte for the next unused code point from 256 up (the mapping ``pre_tokenizers.ByteLevel``
    applies to text before the vocabulary sees it)."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def export_run(
    run: str | Path, out: str | Path, *, adapter: bool = False, model_dir: str | None = None
) -> Path:
    """``ftrain export``: the newest checkpoint of the run folder ``run`` (or the checkpoint
    folder ``run``) written to ``out`` as a Hugging Face directory, with the params the run
    evaluates with (LoRA merged, schedule-free averaged), the tokenizer and the run's chat
    template; with ``adapter``, a LoRA run's adapters as a PEFT folder (:func:`export_peft`).
    ``model_dir``: the run's model folder when it moved (checked against the run's sha256)."""
    from ftrain.app.recipes.finetune import load_run

    loaded = load_run(run, model_dir=model_dir, command="ftrain export")
    cfg, out = loaded.cfg, Path(out)
    if adapter:
        if "lora" not in loaded.state.extra.keys() or not cfg.model_dir:
            raise SystemExit(
                f"ftrain export --adapter: {run} is not a LoRA run of a --model-dir model, so it "
                "has no adapters for peft; export the whole model without --adapter"
            )
        export_peft(loaded.state, out, base_model=cfg.model_dir, params=_eval_adapters(loaded))
    elif cfg.model_dir:  # a Hugging Face model: its own class, dtype and tokenizer files
        from ftrain.models.hf import load_causal_lm, saved_dtype, saved_use_cache

        model = load_causal_lm(cfg.model_dir, dtype=saved_dtype(cfg.model_dir))
        model.config.use_cache = saved_use_cache(cfg.model_dir)  # load_causal_lm turned it off
        export_hf(model.eval(), loaded.params, out)
    else:
        export_gpt(loaded.model, loaded.params, out)
    if cfg.model_dir:
        _copy_tokenizer(Path(cfg.model_dir), out)
    _write_template(out, loaded.template)
    return out


def export_peft(
    state: TensorDictBase, out: str | Path, *, base_model: str | None = None, params=None
) -> Path:
    """A LoRA state's adapters as a PEFT folder: ``adapter_config.json`` (``r``, ``lora_alpha``,
    ``target_modules`` as the targets' full module paths, no dropout, no bias) and
    ``adapter_model.safetensors`` (``base_model.model.<path>.lora_A.weight`` (r, in) and
    ``lora_B.weight`` (out, r), peft's names and layouts).

    Guarantees: ``peft.PeftModel.from_pretrained(base, out)``, ``base`` the model the adapters
    were trained on, gives the logits of ``ft.apply(base, ft.merge_lora(state), x)`` (fp32:
    1e-5). ``params``: the adapters to write (default ``state.params``; e.g. a schedule-free
    run's averaged ones). ``base_model``: recorded as ``base_model_name_or_path``.
    """
    from safetensors.torch import save_file

    if "lora" not in state.extra.keys():
        raise ValueError("export_peft(state, ...): state is not a LoRA run's (no extra['lora']).")
    adapters = tree.to_flat(state.params if params is None else params)
    layouts = {k: bool(v) for k, v in tree.to_flat(state.extra["lora", "fan_in_fan_out"]).items()}
    rank = adapters[f"{next(iter(layouts))}.lora_A"].shape[0]
    tensors = {}
    for path in layouts:
        for part in ("lora_A", "lora_B"):
            weight = adapters[f"{path}.{part}"].detach().to("cpu", torch.float32).contiguous()
            tensors[f"base_model.model.{path}.{part}.weight"] = weight
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(Path(base_model).resolve()) if base_model else None,
        "r": rank,
        "lora_alpha": float(state.extra["lora", "scaling"]) * rank,
        "target_modules": sorted(layouts),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": any(layouts.values()),  # GPT-2's Conv1D; peft sets it per layer too
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "modules_to_save": None,
    }
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _eval_adapters(loaded):
    """The adapters the run evaluates with (``gpt.eval_params`` before merging)."""
    from ftrain import optim
    from ftrain.app.recipes import gpt

    state = loaded.state
    if loaded.cfg.optimizer in gpt.SCHEDULE_FREE:
        return optim.schedule_free_eval_params(state.opt_state, state.params)
    return state.params


def _copy_tokenizer(src: Path, out: Path) -> None:
    import shutil

    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json"):  # fmt: skip
        if (src / name).exists() and not (out / name).exists():
            shutil.copy2(src / name, out / name)


def _write_template(out: Path, template: str | None) -> None:
    """The run's chat template into ``out/tokenizer_config.json`` (``chat_template``), where
    ``AutoTokenizer`` reads it; a ``chat_template.jinja`` there, which would win, is replaced."""
    if template is None:
        return
    file = out / "tokenizer_config.json"
    config = json.loads(file.read_text()) if file.is_file() else {}
    config["chat_template"] = template
    file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    if (out / "chat_template.jinja").exists():
        (out / "chat_template.jinja").write_text(template)
