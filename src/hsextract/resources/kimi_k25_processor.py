"""Kimi-K2.5's processor, in miniature (written by hsextract.tinymodel.kimi_k25_checkpoint).

preprocessor_config.json maps AutoProcessor to `kimi_k25_processor.KimiK25Processor`, as Kimi-K2.5's does:
the image processor (KimiK25VisionProcessor, also reachable as `media_processor`, the name SGLang reads) and
the tokenizer (tokenization_kimi.TikTokenTokenizer). `processor(text=..., medias=[{"type": "image", "image":
img}])` tokenizes the text (its `<|media_pad|>` runs already expanded by the caller, as SGLang does) and
preprocesses the images; `processor(messages=...)` renders the chat template first.
"""

from __future__ import annotations

from typing import Any

from transformers.feature_extraction_utils import BatchFeature
from transformers.processing_utils import ProcessorMixin


class KimiK25Processor(ProcessorMixin):
    attributes = ["image_processor", "tokenizer"]
    valid_kwargs = ["chat_template"]
    image_processor_class = "AutoImageProcessor"
    tokenizer_class = "AutoTokenizer"

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(image_processor, tokenizer, chat_template=chat_template)
        self.media_processor = image_processor

    def __call__(self, messages: list[dict[str, Any]] | None = None, medias: list[dict[str, Any]] | None = None,
                 text: str | list[str] | None = None, return_tensors: str = "pt", **kwargs: Any) -> BatchFeature:
        if messages is None and text is None:
            raise ValueError("KimiK25Processor: give `messages`, or `text` (and optionally `medias`)")
        if medias is None:
            medias = [] if messages is None else self._medias_of(messages)
        if text is None:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        data = dict(self.tokenizer(text, add_special_tokens=False, return_tensors=return_tensors))
        if medias:
            data.update(self.media_processor.preprocess(medias, return_tensors=return_tensors).data)
        return BatchFeature(data=data)

    @staticmethod
    def _medias_of(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for m in messages:
            content = m.get("content")
            for part in content if isinstance(content, list) else []:
                if isinstance(part, dict) and part.get("type") in ("image", "image_url"):
                    out.append({"type": "image", "image": part.get("image", part.get("image_url"))})
        return out

    def batch_decode(self, *args: Any, **kwargs: Any) -> list[str]:
        return self.tokenizer.batch_decode(*args, **kwargs)

    def decode(self, *args: Any, **kwargs: Any) -> str:
        return self.tokenizer.decode(*args, **kwargs)

    @property
    def model_input_names(self) -> list[str]:
        return ["input_ids", "attention_mask", "pixel_values", "grid_thws"]
