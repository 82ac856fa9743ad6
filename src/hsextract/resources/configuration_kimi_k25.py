"""Kimi-K2.5's configuration class, in miniature (written by hsextract.tinymodel.kimi_k25_checkpoint).

Kimi-K2.5's config.json maps AutoConfig (`auto_map`) to `configuration_kimi_k25.KimiK25Config`, so
`AutoConfig.from_pretrained(dir, trust_remote_code=True)` (SGLang's config parser and its processor loader
do that) imports this module from the model directory. Like the published class it is a wrapper: the
language model's settings in `text_config`, rebuilt as a DeepSeek-V3 config (the raw file says
`model_type: kimi_k2`), the MoonViT settings in `vision_config` (kept as written), and the multimodal ids.
"""

from __future__ import annotations

from typing import Any

from transformers import DeepseekV3Config, PretrainedConfig


class KimiK25Config(PretrainedConfig):
    model_type = "kimi_k25"

    def __init__(
        self,
        text_config: dict[str, Any] | DeepseekV3Config | None = None,
        vision_config: dict[str, Any] | None = None,
        ignore_index: int = -100,
        media_placeholder_token_id: int = 163605,
        pad_token_id: int = 0,
        use_unified_vision_chunk: bool = False,
        video_placeholder: str = "<|kimi_k25_video_placeholder|>",
        **kwargs: Any,
    ) -> None:
        if text_config is None:
            text_config = DeepseekV3Config()
        elif isinstance(text_config, dict):
            text_config = DeepseekV3Config(**{k: v for k, v in text_config.items() if k != "model_type"})
        self.text_config = text_config
        self.vision_config = dict(vision_config or {})
        self.ignore_index = ignore_index
        self.media_placeholder_token_id = media_placeholder_token_id
        self.use_unified_vision_chunk = use_unified_vision_chunk
        self.video_placeholder = video_placeholder
        if getattr(text_config, "quantization_config", None) is not None and "quantization_config" not in kwargs:
            kwargs["quantization_config"] = text_config.quantization_config
        super().__init__(pad_token_id=pad_token_id, **kwargs)

    def get_text_config(self, *args: Any, **kwargs: Any) -> DeepseekV3Config:
        return self.text_config

    @property
    def hidden_size(self) -> int:
        return self.text_config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.text_config.vocab_size
