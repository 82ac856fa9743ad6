"""Kimi-K2.5's image processor, in miniature (written by hsextract.tinymodel.kimi_k25_checkpoint).

preprocessor_config.json maps AutoImageProcessor to `kimi_k25_vision_processing.KimiK25VisionProcessor` and
holds its settings under `media_proc_cfg`, as Kimi-K2.5's does. SGLang's Kimi-K2.5 multimodal processor
reads `media_proc_cfg` (patch_size, merge_kernel_size, in_patch_limit, patch_limit_on_one_side,
fixed_output_tokens, image_mean, image_std) when the server starts, and calls `media_tokens_calculator`
and `preprocess` for image requests on the CPU path. Images only: the miniature has no video support.

NaViT resize: scale an image down (never up) until it has at most `in_patch_limit` patches and at most
`patch_limit_on_one_side` on a side, pad it to a multiple of patch_size * merge_kernel_size, normalise,
cut it into patches; one placeholder token per merge_kernel_size^2 patches.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature

DEFAULT_MEDIA_PROC_CFG: dict[str, Any] = {
    "patch_size": 14,
    "merge_kernel_size": 2,
    "in_patch_limit": 1024,
    "patch_limit_on_one_side": 32,
    "fixed_output_tokens": None,
    "temporal_merge_kernel_size": 4,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def _image(media: Any) -> Any:
    from PIL import Image

    img = media["image"] if isinstance(media, dict) else media
    if not isinstance(img, Image.Image):
        raise TypeError(f"KimiK25VisionProcessor: expected a PIL image, got {type(img).__name__}")
    if isinstance(media, dict) and media.get("type", "image") != "image":
        raise ValueError(f"KimiK25VisionProcessor: media type {media.get('type')!r}; this miniature takes images only")
    return img.convert("RGB")


class KimiK25VisionProcessor(BaseImageProcessor):
    model_input_names = ["pixel_values", "grid_thws"]

    def __init__(self, media_proc_cfg: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.media_proc_cfg = {**DEFAULT_MEDIA_PROC_CFG, **(media_proc_cfg or {})}
        self.num_frames_per_chunk = self.media_proc_cfg["temporal_merge_kernel_size"]

    def get_resize_config(self, media: Any) -> dict[str, int]:
        cfg = self.media_proc_cfg
        width, height = _image(media).size
        patch, merge = cfg["patch_size"], cfg["merge_kernel_size"]
        side = cfg["patch_limit_on_one_side"]
        scale = min(1.0, math.sqrt(cfg["in_patch_limit"] / (max(1.0, width // patch) * max(1.0, height // patch))),
                    side * patch / width, side * patch / height)
        new_w = min(max(1, int(width * scale)), side * patch)
        new_h = min(max(1, int(height * scale)), side * patch)
        factor = merge * patch
        pad_w, pad_h = (factor - new_w % factor) % factor, (factor - new_h % factor) % factor
        tokens = cfg["fixed_output_tokens"]
        if tokens is None:
            tokens = ((new_h + pad_h) // factor) * ((new_w + pad_w) // factor)
        return {"num_tokens": int(tokens), "new_width": new_w, "new_height": new_h, "pad_width": pad_w,
                "pad_height": pad_h}

    def media_tokens_calculator(self, media: Any) -> int:
        return self.get_resize_config(media)["num_tokens"]

    def split_video_chunks(self, video: Any, **kwargs: Any) -> list[dict[str, Any]]:
        raise NotImplementedError("the hsextract Kimi-K2.5 miniature processes images only")

    def preprocess(self, medias: list[Any], return_tensors: str | None = "pt", **kwargs: Any) -> BatchFeature:
        cfg = self.media_proc_cfg
        patch = cfg["patch_size"]
        mean = np.asarray(cfg["image_mean"], dtype=np.float32)
        std = np.asarray(cfg["image_std"], dtype=np.float32)
        pixels, grids = [], []
        for media in medias:
            from PIL import Image

            r = self.get_resize_config(media)
            img = _image(media).resize((r["new_width"], r["new_height"]), resample=Image.Resampling.BICUBIC)
            arr = np.pad(np.asarray(img, dtype=np.float32) / 255.0, ((0, r["pad_height"]), (0, r["pad_width"]), (0, 0)))
            arr = (arr - mean) / std
            h, w = arr.shape[0] // patch, arr.shape[1] // patch
            patches = arr.reshape(h, patch, w, patch, 3).transpose(0, 2, 4, 1, 3).reshape(-1, 3, patch, patch)
            pixels.append(torch.from_numpy(np.ascontiguousarray(patches)))
            grids.append(torch.tensor([1, h, w], dtype=torch.int64))
        data = {
            "pixel_values": torch.cat(pixels) if pixels else torch.empty(0, 3, patch, patch),
            "grid_thws": torch.stack(grids) if grids else torch.empty(0, 3, dtype=torch.int64),
        }
        return BatchFeature(data=data, tensor_type=return_tensors)
