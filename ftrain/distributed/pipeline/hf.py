"""Hugging Face model families for ``ft.pipeline``: how a stage of a GPT-2 or Llama runs.

**Rule:** the stages of a ``GPT2LMHeadModel`` or ``LlamaForCausalLM``, run one after the other,
compute what the model's own forward computes for token ids alone (no attention mask, no
position ids, no cache): the same modules called with the same arguments, in the same order.
Each stage builds the causal mask as the model does (``transformers.masking_utils.
create_causal_mask``, from the config's attention implementation: ``"sdpa"`` or ``"eager"``) and
uses positions ``0 .. T-1``; a Llama stage computes the rotary position embeddings with its own
copy of ``model.rotary_emb`` (buffers only, kept by every stage). So the chained stages give the
whole model's logits, bitwise on the same kernels.

The code here follows ``transformers`` 5's ``modeling_gpt2.py`` and ``modeling_llama.py``
(``GPT2Model.forward``, ``LlamaModel.forward``); ``check`` refuses an older ``transformers``,
whose blocks take other arguments. ``transformers`` is imported only once a model could be one of
its classes (see :func:`_hf_class`), so ``ft.pipeline`` on other models never loads it.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from ftrain.distributed.pipeline.family import Family, refuse_packed

__all__ = ["HF_FAMILIES", "GPT2_FAMILY", "LLAMA_FAMILY"]

# Keyword arguments of the model call that leave its logits as the stages compute them, whatever
# their value (return_dict=False: the logits in a tuple, as the model returns them).
_HONOURED = {"input_ids", "use_cache", "return_dict"}
# Those the model call may pass at their default only (the default given).
_AT_DEFAULT = {"logits_to_keep": 0, "output_attentions": False, "output_hidden_states": False}


def _hf_class(name: str) -> type | None:
    """``transformers.<name>``, or None where transformers is not installed or not yet imported
    (no module can then be an instance of its classes: no need to pay for the import)."""
    if "transformers" not in sys.modules:
        return None
    try:
        import transformers

        return getattr(transformers, name)
    except (ImportError, AttributeError):
        return None


def _matches(name: str):
    def matches(module: nn.Module) -> bool:
        cls = _hf_class(name)
        return cls is not None and isinstance(module, cls)

    return matches


def _causal_mask(config, x: torch.Tensor, positions: torch.Tensor):
    """The mask the model builds for rows of ``x`` (B, T, ...) with no padding mask and no cache:
    for ``sdpa`` usually None (its ``is_causal``), for ``eager`` a (B, 1, T, T) additive mask."""
    from transformers.masking_utils import create_causal_mask

    return create_causal_mask(
        config=config, inputs_embeds=x, attention_mask=None, cache=None, position_ids=positions
    )


def _gpt2_run(m: nn.Module, x: torch.Tensor, first: bool, last: bool) -> torch.Tensor:
    """One stage of a ``GPT2LMHeadModel``, as ``GPT2Model.forward`` runs it."""
    t = m.transformer
    positions = torch.arange(x.shape[1], device=x.device)[None]  # (1, T)
    if first:  # (B, T) token ids -> (B, T, d)
        x = t.drop(t.wte(x) + t.wpe(positions))
    mask = _causal_mask(t.config, x, positions)
    for block in t.h:
        # as GPT2Model calls it: (hidden, cache, mask, encoder_hidden_states, ...)
        x = block(
            x,
            None,
            mask,
            None,
            encoder_attention_mask=None,
            use_cache=False,
            position_ids=positions,
        )
    if last:  # (B, T, d) -> (B, T, vocab)
        x = m.lm_head(t.ln_f(x))
    return x


def _llama_run(m: nn.Module, x: torch.Tensor, first: bool, last: bool) -> torch.Tensor:
    """One stage of a ``LlamaForCausalLM``, as ``LlamaModel.forward`` runs it."""
    inner = m.model
    positions = torch.arange(x.shape[1], device=x.device)[None]  # (1, T)
    if first:  # (B, T) token ids -> (B, T, d)
        x = inner.embed_tokens(x)
    mask = _causal_mask(inner.config, x, positions)
    rope = inner.rotary_emb(x, position_ids=positions)  # (cos, sin), each (1, T, head_dim)
    for layer in inner.layers:
        x = layer(
            x,
            attention_mask=mask,
            position_embeddings=rope,
            position_ids=positions,
            cache=None,
            use_cache=False,
        )
    if last:  # (B, T, d) -> (B, T, vocab)
        x = m.lm_head(inner.norm(x))
    return x


def _output(family: str, output_class: str):
    """``Family.output`` for a causal LM: the model's output object holding the stage's logits;
    raises for a call whose result would depend on what the stages do not compute."""

    def output(y: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        refuse_packed(kwargs, family)
        if kwargs.get("labels") is not None:
            raise ValueError(
                f"ft.pipeline ({family}): the model call's labels= is not honoured (the stages "
                "return logits only); compute the loss from them instead: "
                "ft.losses.causal_lm(out.logits, labels)."
            )
        extra = [k for k, v in kwargs.items() if k not in _HONOURED and v is not None]
        extra = [k for k in extra if not (k in _AT_DEFAULT and kwargs[k] == _AT_DEFAULT[k])]
        if extra or any(a is not None for a in args[1:]):
            what = ", ".join(f"{k}=" for k in extra) or "a second positional argument"
            raise ValueError(
                f"ft.pipeline ({family}): the stages run the model on token ids alone, so the "
                f"model call's {what} is not honoured; call model(input_ids) only."
            )
        ids = args[0] if args else kwargs.get("input_ids")
        if ids is not None and tuple(ids.shape) != tuple(y.shape[:-1]):
            raise ValueError(
                f"ft.pipeline ({family}): the model call got token ids of shape "
                f"{tuple(ids.shape)}, but the stages ran the batch's inputs {tuple(y.shape[:-1])}; "
                "call the model on the batch field ft.pipeline(inputs=...) reads, unchanged."
            )
        from transformers import modeling_outputs

        out = getattr(modeling_outputs, output_class)(logits=y)
        return out.to_tuple() if kwargs.get("return_dict") is False else out

    return output


def _check_transformers(family: str) -> None:
    import transformers

    major = int(transformers.__version__.split(".")[0])
    if major < 5:
        raise ValueError(
            f"ft.pipeline ({family}): the stage code follows transformers 5's modeling code; "
            f"transformers {transformers.__version__} is installed. Fix: pip install "
            "'transformers>=5', or pass family=ft.distributed.pipeline.Family(...)."
        )


def _gpt2_check(model: nn.Module) -> None:
    _check_transformers("HF GPT-2")


def _llama_check(model: nn.Module) -> None:
    _check_transformers("HF Llama")
    n, layers = model.config.num_hidden_layers, len(model.model.layers)
    if layers != n:
        raise ValueError(
            f"ft.pipeline (HF Llama): the model runs its first num_hidden_layers={n} of "
            f"{layers} layers; the stages run every layer. Fix: keep only the {n} layers it runs "
            f"(model.model.layers = model.model.layers[:{n}])."
        )


GPT2_FAMILY = Family(
    name="HF GPT-2",
    matches=_matches("GPT2LMHeadModel"),
    blocks="transformer.h",
    first=("transformer.wte", "transformer.wpe", "transformer.drop"),
    last=("transformer.ln_f", "lm_head"),
    run=_gpt2_run,
    output=_output("HF GPT-2", "CausalLMOutputWithCrossAttentions"),
    check=_gpt2_check,
)

LLAMA_FAMILY = Family(
    name="HF Llama",
    matches=_matches("LlamaForCausalLM"),
    blocks="model.layers",
    first=("model.embed_tokens",),
    last=("model.norm", "lm_head"),  # model.rotary_emb: no params, every stage keeps it
    run=_llama_run,
    output=_output("HF Llama", "CausalLMOutputWithPast"),
    check=_llama_check,
)

HF_FAMILIES: tuple[Family, ...] = (GPT2_FAMILY, LLAMA_FAMILY)
