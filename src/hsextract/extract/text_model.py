"""The language model of a checkpoint, loaded with transformers: the checkpoint itself, or the text model
inside a multimodal wrapper.

Kimi-K2.5 ships as `KimiK25ForConditionalGeneration`: config.json nests the language model's settings in
`text_config` (architectures [DeepseekV3ForCausalLM]) and its weights are named `language_model.model.*`
and `language_model.lm_head.*`, beside `vision_tower.*` and `mm_projector.*`. Its own model class is custom
code (and transformers' native one builds the vision tower too), so for such a wrapper this module builds the
text model's class from `text_config` and loads the weights under the text model's prefix with the prefix
stripped; the other weights are not read. Everything else goes through AutoModelForCausalLM as before.

A wrapper here: a local directory or cached hub id whose config.json has a nested text config (model_info)
naming a causal LM class transformers has (the text config's `architectures[0]`, else the class transformers
maps its `model_type` to: Gemma-3's text config names no class), and whose weights put that model's final norm
under a prefix (`<prefix>model.norm.weight`). A wrapper whose own `model_type` transformers maps to that same
class (Llama-4) is not one here: AutoModelForCausalLM loads it from the whole config, `quantization_config`
included. A `quantization_config` in the text config is dropped when the checkpoint holds no quantized tensor
(the hsextract miniature's covers no layer, hsextract.tinymodel.kimi_k25_checkpoint); with packed weights
(Kimi-K2.5's int4 experts) this engine refuses, naming the tensor.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsextract.config.model_info import text_config
from hsextract.errors import EngineError

NORM_SUFFIX = "model.norm.weight"
# names of the tensors a quantized checkpoint stores instead of (or beside) `weight`
QUANTIZED_SUFFIXES = frozenset({"weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx",
                                "qweight", "qzeros", "scales", "g_idx", "weight_scale_inv"})
WEIGHTS_INDEX, WEIGHTS_FILE = "model.safetensors.index.json", "model.safetensors"


@dataclass(frozen=True)
class WrappedTextModel:
    """Where a wrapper checkpoint keeps its text model."""

    wrapper: str  # config.json's architectures[0]
    architecture: str  # the text model's class (text_config architectures[0], or its model_type's)
    config: dict[str, Any]  # text_config, as written
    prefix: str  # of the text model's weight names, e.g. "language_model."
    weight_names: tuple[str, ...]  # every weight name of the checkpoint


def _file(model: str, name: str) -> Path | None:
    local = Path(model)
    if local.is_dir():
        return local / name if (local / name).is_file() else None
    try:
        from transformers.utils import cached_file

        got = cached_file(model, name, _raise_exceptions_for_missing_entries=False)
    except Exception:  # noqa: BLE001 - not cached, no hub access: not a wrapper we can read
        return None
    return Path(got) if got else None


def weight_names(model: str) -> list[str]:
    """Every tensor name of a safetensors checkpoint (its index, else model.safetensors); [] when neither."""
    index = _file(model, WEIGHTS_INDEX)
    if index is not None:
        return sorted(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
    single = _file(model, WEIGHTS_FILE)
    if single is None:
        return []
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return sorted(f.keys())


def find_wrapped_text_model(model: str) -> WrappedTextModel | None:
    """The text model of a multimodal wrapper checkpoint (module docstring), or None for anything else."""
    cfg_path = _file(model, "config.json")
    if cfg_path is None:
        return None
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except ValueError:
        return None
    text = text_config(cfg) if isinstance(cfg, dict) else None
    if text is None or text is cfg:
        return None
    archs = text.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else \
        causal_lm_class(text.get("model_type"))
    if not (isinstance(arch, str) and arch.endswith("ForCausalLM")):
        return None
    if causal_lm_class(cfg.get("model_type")) == arch:  # transformers' own Auto class loads this text model
        return None  # from the whole config (Llama-4: with its quantization_config, which the wrapper path drops)
    names = weight_names(model)
    norms = sorted((n for n in names if n.endswith("." + NORM_SUFFIX)), key=len)
    if not norms:
        return None
    wrapper = (cfg.get("architectures") or ["?"])[0]
    return WrappedTextModel(str(wrapper), arch, text, norms[0][: -len(NORM_SUFFIX)], tuple(names))


def causal_lm_class(model_type: Any) -> str | None:
    """transformers' causal-LM class for a text config that names none (Gemma-3's wrapper: `gemma3_text` ->
    Gemma3ForCausalLM), or None."""
    if not isinstance(model_type, str):
        return None
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return None
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)


def load_causal_lm(model: str, dtype: Any, attn_implementation: str | None = None) -> Any:
    """A transformers causal LM: the wrapper's text model, or AutoModelForCausalLM.from_pretrained(model);
    `attn_implementation` None: transformers' default."""
    wrapped = find_wrapped_text_model(model)
    if wrapped is None:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation=attn_implementation)
    return load_wrapped_text_model(model, wrapped, dtype, attn_implementation)


def quantized_refusal(model: str, wrapped: WrappedTextModel) -> str | None:
    """Why this engine cannot load a wrapper's text model whose weights are packed (Kimi-K2.5's int4 experts), or
    None: transformers has no kernel for them here (config.checks says so before any job, this at load)."""
    packed = [n for n in wrapped.weight_names if n.startswith(wrapped.prefix)
              and n.rsplit(".", 1)[-1] in QUANTIZED_SUFFIXES]
    if not packed:
        return None
    return (f"{model} ({wrapped.wrapper}): the text model's weights are quantized ({packed[0]} and {len(packed) - 1} "
            "more); the transformers engine reads unquantized checkpoints only. Use engine: sglang")


def load_wrapped_text_model(model: str, wrapped: WrappedTextModel, dtype: Any,
                            attn_implementation: str | None = None) -> Any:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    where = f"{model} ({wrapped.wrapper})"
    known = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    cls = getattr(transformers, wrapped.architecture, None) if wrapped.architecture in known else None
    if cls is None:
        raise EngineError(f"{where}: its text model is a {wrapped.architecture}, which this transformers "
                          f"({transformers.__version__}) has no causal-LM class for")
    if refusal := quantized_refusal(model, wrapped):
        raise EngineError(refusal)
    cfg = {k: v for k, v in wrapped.config.items() if k not in ("model_type", "quantization_config")}
    config = cls.config_class.from_dict(cfg)
    # the weights outside the text model (vision tower, projector) are skipped, not reported as unexpected
    others = sorted({n.split(".", 1)[0] for n in wrapped.weight_names if not n.startswith(wrapped.prefix)})
    ignore = [rf"^{re.escape(o)}\." for o in others]
    subclass = type(cls.__name__, (cls,), {"_keys_to_ignore_on_load_unexpected": ignore,
                                           "__module__": cls.__module__, "__doc__": cls.__doc__})
    return subclass.from_pretrained(model, config=config, dtype=dtype, attn_implementation=attn_implementation,
                                    key_mapping={f"^{re.escape(wrapped.prefix)}": ""})


__all__ = ["WrappedTextModel", "causal_lm_class", "find_wrapped_text_model", "load_causal_lm",
           "load_wrapped_text_model", "quantized_refusal", "weight_names"]
