"""Hugging Face T5 / Chronos checkpoints -> :class:`.forecast.TokenForecaster`.

A Chronos repository (``amazon/chronos-t5-{tiny,mini,small,base,large}``) holds a T5
``config.json`` with a ``chronos_config`` block and ``model.safetensors`` in Hugging Face's key
names. :func:`convert_hf_t5` renames the keys; :func:`apply_chronos_config` checks the config
against the model and adopts its tokenizer and sampling settings (the hub calls it through
``model.domainfm_upstream_config`` when loading a directory); :func:`load_chronos` loads a local
directory or a whole ``hf://org/repo`` (config + weights) in one call.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Mapping

import torch

__all__ = ["convert_hf_t5", "apply_chronos_config", "load_chronos", "CHRONOS_SHA256", "hf_t5_key"]

# Full sha256 of the published Chronos files, when confirmed. None could be confirmed from here
# (no network), so none is registered: pass sha256= to load_chronos / create_model, or place the
# files in a directory and load that.
CHRONOS_SHA256: dict[str, dict[str, str]] = {}  # "amazon/chronos-t5-tiny" -> {file: sha256}

_BLOCK = re.compile(r"^(encoder|decoder)\.block\.(\d+)\.layer\.(\d+)\.(.+)$")


def hf_t5_key(key: str, is_decoder_stack: bool | None = None) -> str | None:
    """Our key for one Hugging Face T5 key (``None``: a duplicate of ``shared`` to drop)."""
    if key in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
        return None
    if key == "shared.weight" or key == "lm_head.weight":
        return key
    if key in ("encoder.final_layer_norm.weight", "decoder.final_layer_norm.weight"):
        return key.split(".")[0] + ".final_norm.weight"
    m = _BLOCK.match(key)
    if m is None:
        raise KeyError(key)
    stack, block, layer, rest = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
    if rest == "SelfAttention.relative_attention_bias.weight":
        if block != 0 or layer != 0:
            raise KeyError(key)
        return f"{stack}.relative_attention_bias.weight"
    prefix = f"{stack}.blocks.{block}"
    ff_layer = 2 if stack == "decoder" else 1
    if layer == 0:
        sub = {"layer_norm.weight": "self_attn_norm.weight"}
        for p in "qkvo":
            sub[f"SelfAttention.{p}.weight"] = f"self_attn.{p}.weight"
    elif layer == 1 and stack == "decoder":
        sub = {"layer_norm.weight": "cross_attn_norm.weight"}
        for p in "qkvo":
            sub[f"EncDecAttention.{p}.weight"] = f"cross_attn.{p}.weight"
    elif layer == ff_layer:
        sub = {"layer_norm.weight": "ffn_norm.weight", "DenseReluDense.wi.weight": "ffn.wi.weight",
               "DenseReluDense.wo.weight": "ffn.wo.weight"}
    else:
        raise KeyError(key)
    if rest not in sub:
        raise KeyError(key)
    return f"{prefix}.{sub[rest]}"


def convert_hf_t5(state_dict: Mapping[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """Rename a Hugging Face ``T5ForConditionalGeneration`` state_dict to our keys.

    The input embeddings of encoder and decoder duplicate ``shared`` and are dropped (after
    checking they equal it). With tied embeddings ``lm_head.weight`` is optional and must equal
    ``shared.weight`` when present; an untied model needs it.

    Idempotent: a key that is already one of ``model``'s own (our save format, an engine
    checkpoint) passes through unchanged, so converting a converted state_dict changes nothing.
    """
    own = set(model.state_dict()) if isinstance(model, torch.nn.Module) else set()
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for key, value in state_dict.items():
        try:
            ours = hf_t5_key(key)
        except KeyError:
            if key in own:  # no Hugging Face T5 key is spelled like one of ours, so this is ours
                out[key] = value
            else:
                unknown.append(key)
            continue
        if ours is None:
            shared = state_dict.get("shared.weight")
            if shared is not None and not torch.equal(shared, value):
                raise ValueError(f"{key} differs from shared.weight; this checkpoint does not tie its input embeddings")
            if shared is None:
                out["shared.weight"] = value
            continue
        out[ours] = value
    if unknown:
        raise ValueError(
            f"not a T5 encoder-decoder checkpoint: unrecognised key(s) {unknown[:8]}"
            + (" (gated feed-forward, e.g. T5 v1.1, is not supported: Chronos uses ReLU)" if any("wi_0" in k for k in unknown) else "")
        )
    tied = getattr(model, "tie_word_embeddings", True)
    if tied and "lm_head.weight" in out:
        head = out.pop("lm_head.weight")
        if "shared.weight" in out and not torch.equal(head, out["shared.weight"]):
            raise ValueError(
                "checkpoint has an lm_head.weight different from shared.weight, but the model ties its embeddings; "
                "build it with tie_word_embeddings=False"
            )
    return out


def t5_architecture(model, *, vocab: bool = True) -> dict[str, Any]:
    """The sizes of ``model``'s T5 stacks under their Hugging Face ``config.json`` names
    (``vocab_size`` only with ``vocab``: Chronos-Bolt derives it from ``use_reg_token``)."""
    enc, dec = model.encoder, model.decoder
    attn = enc.blocks[0].self_attn
    arch = {
        "d_model": model.d_model,
        "d_kv": attn.d_kv,
        "d_ff": enc.blocks[0].ffn.wi.out_features,
        "num_heads": attn.num_heads,
        "num_layers": len(enc.blocks),
        "num_decoder_layers": len(dec.blocks),
    }
    if vocab:
        arch["vocab_size"] = model.vocab_size
    arch["relative_attention_num_buckets"] = enc.num_buckets
    arch["relative_attention_max_distance"] = enc.max_distance
    return arch


def check_t5_architecture(model, config: Mapping[str, Any], *, variants: str, vocab: bool = True) -> None:
    """Raise ``ValueError`` naming every size of :func:`t5_architecture` that ``config`` (a Hugging
    Face T5 ``config.json``; ``num_decoder_layers`` defaults to ``num_layers``) gives otherwise;
    ``variants`` (e.g. ``"chronos-t5-*"``) is where the message sends the user."""
    arch = t5_architecture(model, vocab=vocab)
    expected = dict(config)
    expected.setdefault("num_decoder_layers", expected.get("num_layers"))
    wrong = [f"{k}: config {expected[k]} vs model {arch[k]}" for k in arch if k in expected and expected[k] != arch[k]]
    if wrong:
        raise ValueError(
            f"config.json describes another architecture than {getattr(model, 'domainfm_name', type(model).__name__)}: "
            + "; ".join(wrong) + f". Use the {variants} variant of the same size (or pass these sizes as keywords)."
        )


def apply_chronos_config(model, config: Mapping[str, Any]) -> None:
    """Check a Hugging Face T5 ``config.json`` against ``model`` and adopt its ``chronos_config``.

    Raises ``ValueError`` naming every architecture field that disagrees (build the matching
    variant instead), and for configs that are not seq2seq ``MeanScaleUniformBins`` Chronos models.
    """
    from .tokenizer import MeanScaleUniformBins

    if not isinstance(config, Mapping):
        raise ValueError(f"upstream config: expected a mapping, got {type(config).__name__}")
    if "domainfm" in config:
        return  # our own save format: nothing to adopt
    check_t5_architecture(model, config, variants="chronos-t5-*")
    proj = config.get("feed_forward_proj", "relu")
    if proj != "relu":
        raise ValueError(f"config.json feed_forward_proj={proj!r}: only 'relu' (Chronos's T5) is supported")
    if config.get("tie_word_embeddings", True) is False and model.lm_head is None:
        raise ValueError("config.json has tie_word_embeddings=false but the model ties them; build it with tie_word_embeddings=False")
    chronos = config.get("chronos_config")
    if chronos is None:
        return
    if chronos.get("model_type", "seq2seq") != "seq2seq":
        raise ValueError(f"chronos_config.model_type={chronos.get('model_type')!r}: only seq2seq Chronos models load here")
    if chronos.get("tokenizer_class", "MeanScaleUniformBins") != "MeanScaleUniformBins":
        raise ValueError(f"chronos_config.tokenizer_class={chronos.get('tokenizer_class')!r}: only MeanScaleUniformBins is supported")
    n_tokens = int(chronos.get("n_tokens", model.vocab_size))
    if n_tokens != model.vocab_size:
        raise ValueError(f"chronos_config.n_tokens={n_tokens} but the model's vocabulary has {model.vocab_size} tokens")
    kwargs = dict(chronos.get("tokenizer_kwargs", {}))
    context_length = int(chronos.get("context_length", model.context_length))
    model.tokenizer = MeanScaleUniformBins(
        float(kwargs.get("low_limit", -15.0)), float(kwargs.get("high_limit", 15.0)), n_tokens=n_tokens,
        n_special_tokens=int(chronos.get("n_special_tokens", 2)), pad_token_id=int(chronos.get("pad_token_id", 0)),
        eos_token_id=int(chronos.get("eos_token_id", 1)), use_eos_token=bool(chronos.get("use_eos_token", True)),
        context_length=context_length,
    )
    model.tokenizer_kind = "chronos"
    model.context_length = context_length
    model.prediction_length = int(chronos.get("prediction_length", model.prediction_length))
    model.num_samples = int(chronos.get("num_samples", model.num_samples))
    model.temperature = float(chronos.get("temperature", model.temperature))
    model.top_k = int(chronos.get("top_k", model.top_k))
    model.top_p = float(chronos.get("top_p", model.top_p))
    model.decoder_start_token_id = int(config.get("decoder_start_token_id", model.decoder_start_token_id))
    # so that save_pretrained writes a config that rebuilds this exact model
    record = getattr(model, "domainfm_kwargs", None)
    if isinstance(record, dict):
        record.update(tokenizer="chronos", context_length=context_length, prediction_length=model.prediction_length,
                      num_samples=model.num_samples, temperature=model.temperature, top_k=model.top_k, top_p=model.top_p,
                      tokenizer_kwargs={"low_limit": model.tokenizer.low_limit, "high_limit": model.tokenizer.high_limit,
                                        "n_special_tokens": model.tokenizer.n_special_tokens,
                                        "pad_token_id": model.tokenizer.pad_token_id,
                                        "eos_token_id": model.tokenizer.eos_token_id,
                                        "use_eos_token": model.tokenizer.use_eos_token})


def _variant_for(config: Mapping[str, Any]) -> str:
    from domainfm import list_models, zoo

    for name in list_models("chronos-t5-*"):
        defaults = zoo.get_card(name).defaults
        if all(defaults.get(k) == config.get(k) for k in ("d_model", "num_layers", "num_heads", "d_ff")):
            return name
    raise ValueError(
        f"config.json (d_model={config.get('d_model')}, num_layers={config.get('num_layers')}) matches no registered "
        "chronos-t5-* variant; call domainfm.create_model('chronos-t5-tiny', pretrained=DIR, d_model=…, …) with its sizes"
    )


def load_chronos(source: str | os.PathLike, *, name: str | None = None, sha256: Mapping[str, str] | None = None,
                 **kwargs):
    """A Chronos model from a directory laid out as its Hugging Face repository, or from
    ``"hf://org/repo"`` (``config.json`` and ``model.safetensors`` are fetched into the cache and
    verified against ``sha256={"config.json": …, "model.safetensors": …}`` or the registered
    digests; a file without a known digest is fetched with a warning that prints its digest).

    ``name`` picks the variant (default: the ``chronos-t5-*`` whose sizes match ``config.json``).
    """
    import json

    from domainfm import hub

    text = str(source)
    if text.startswith("hf://"):
        repo = text[len("hf://"):].strip("/")
        if repo.count("/") != 1:
            raise ValueError(f"{source!r}: expected hf://org/repo (a whole repository); for one file use create_model(pretrained=...)")
        digests = dict(CHRONOS_SHA256.get(repo, {}))
        digests.update(sha256 or {})
        paths = [hub.fetch(f"hf://{repo}/{f}", digests.get(f)) for f in ("config.json", "model.safetensors")]
        directory = Path(paths[1]).parent
        if Path(paths[0]).parent != directory:  # pragma: no cover - the cache keeps a repo's files together
            raise hub.HubError(f"{source}: config.json and model.safetensors were cached in different folders")
    else:
        directory = Path(source)
        if not directory.is_dir():
            raise FileNotFoundError(f"{source}: not a directory (expected config.json + model.safetensors)")
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{directory}: no config.json (a Chronos repository has one with a chronos_config block)")
    config = json.loads(config_file.read_text())
    name = name or _variant_for(config)
    return hub.create_model(name, pretrained=str(directory), **kwargs)
