"""Images: decoding untrusted bytes, CLIP-style preprocessing, content hashes, placeholders."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from pdcluster.engine.request import MultiModalFeature

MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_IMAGE_PIXELS = 4096 * 4096
# Resizing the short side to the model's size scales the long side by the same factor: a
# 1 x 16M-pixel strip would become gigabytes. (Qwen2-VL's processor draws the line at 200.)
MAX_ASPECT_RATIO = 200
# Formats whose decoders are plain Pillow code (EPS, for one, would run Ghostscript).
ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
_DATA_URL = re.compile(r"^data:(?P<mime>[^;,]*)(?P<params>(;[^;,]*)*),(?P<data>.*)$", re.DOTALL)


def decode_data_url(url: str, max_bytes: int = MAX_IMAGE_BYTES) -> bytes:
    """The bytes of a `data:image/<type>;base64,<data>` URL; ValueError when malformed."""
    match = _DATA_URL.match(url.strip()) if isinstance(url, str) else None
    if match is None:
        raise ValueError("malformed data URL: expected 'data:image/<type>;base64,<data>'")
    if not match["mime"].lower().startswith("image/"):
        raise ValueError(f"data URL media type must be image/*, got {match['mime']!r}")
    if ";base64" not in match["params"].lower():
        raise ValueError("data URL must be base64-encoded (';base64,')")
    payload = re.sub(r"\s+", "", match["data"])
    if len(payload) * 3 // 4 > max_bytes:
        raise ValueError(f"image data exceeds {max_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"data URL has invalid base64: {e}") from e
    if not data:
        raise ValueError("data URL holds no data")
    return data


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited onto white (as CLIP preprocessing does)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def load_image(
    data: bytes, max_pixels: int = MAX_IMAGE_PIXELS, max_bytes: int = MAX_IMAGE_BYTES
) -> Image.Image:
    """Decode untrusted image bytes into an RGB image (the first frame of an animation).

    ValueError on anything that is not a readable image of an allowed format, or whose
    declared size exceeds `max_pixels` or `MAX_ASPECT_RATIO` (checked from the header, before
    decoding pixels).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) == 0:
        raise ValueError("image data is empty or not bytes")
    if len(data) > max_bytes:
        raise ValueError(f"image data exceeds {max_bytes} bytes")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
            width, height = image.size
            if width < 1 or height < 1 or width * height > max_pixels:
                raise ValueError(f"image is {width}x{height}; at most {max_pixels} pixels allowed")
            if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
                raise ValueError(
                    f"image is {width}x{height}; its aspect ratio must be at most {MAX_ASPECT_RATIO}"
                )
            image.load()
    except ValueError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ValueError(f"image rejected as a decompression bomb: {e}") from e
    except Exception as e:  # any decoder failure on untrusted bytes means "not an image"
        raise ValueError(f"not a valid image ({', '.join(ALLOWED_FORMATS)}): {e}") from e
    return _to_rgb(image)


def mm_hash(image: Image.Image) -> str:
    """Content hash of the decoded pixels: equal pictures hash equal whatever their container."""
    header = f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode()
    return hashlib.sha256(header + image.tobytes()).hexdigest()


def _size_dict(value: Any) -> dict[str, int]:
    if isinstance(value, int):
        return {"shortest_edge": value}
    return {k: int(v) for k, v in (value or {}).items()}


@dataclass(frozen=True)
class ImageProcessorConfig:
    """The fields of a CLIP-style preprocessor_config.json that preprocessing uses."""

    size: dict[str, int]  # {"shortest_edge": n} or {"height": h, "width": w}
    crop_size: dict[str, int]  # {"height": h, "width": w}
    do_resize: bool = True
    do_center_crop: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
    resample: int = 3  # PIL bicubic

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ImageProcessorConfig:
        size = _size_dict(config.get("size", {"shortest_edge": 224}))
        crop = _size_dict(config.get("crop_size", size))
        if "shortest_edge" in crop:  # a bare int crop size means a square
            crop = {"height": crop["shortest_edge"], "width": crop["shortest_edge"]}
        fields = {"size": size, "crop_size": crop}
        for name in ("do_resize", "do_center_crop", "do_rescale", "do_normalize", "do_convert_rgb"):
            if name in config:
                fields[name] = bool(config[name])
        if "rescale_factor" in config:
            fields["rescale_factor"] = float(config["rescale_factor"])
        for name in ("image_mean", "image_std"):
            if name in config:
                value = config[name]
                fields[name] = tuple(
                    float(v) for v in (value if isinstance(value, list) else [value] * 3)
                )
        if "resample" in config:
            fields["resample"] = int(config["resample"])
        return cls(**fields)


class ImageProcessor:
    """PIL image -> normalized float32 [3, H, W] tensor, as CLIPImageProcessor computes it."""

    def __init__(self, config: ImageProcessorConfig) -> None:
        self.config = config
        self._mean = torch.tensor(config.image_mean, dtype=torch.float32).view(3, 1, 1)
        self._std = torch.tensor(config.image_std, dtype=torch.float32).view(3, 1, 1)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ImageProcessor:
        path = Path(model_dir) / "preprocessor_config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} has no preprocessor_config.json")
        return cls(ImageProcessorConfig.from_dict(json.loads(path.read_text(encoding="utf-8"))))

    def _resize(self, image: Image.Image) -> Image.Image:
        size, (width, height) = self.config.size, image.size
        if "shortest_edge" in size:
            short, long = min(width, height), max(width, height)
            new_short, new_long = size["shortest_edge"], int(size["shortest_edge"] * long / short)
            new_w, new_h = (new_short, new_long) if width <= height else (new_long, new_short)
        else:
            new_w, new_h = size["width"], size["height"]
        return image.resize((new_w, new_h), resample=Image.Resampling(self.config.resample))

    def _center_crop(self, pixels: np.ndarray) -> np.ndarray:
        """[H, W, C] -> [crop_h, crop_w, C]; zero-pads centered when the image is smaller."""
        crop_h, crop_w = self.config.crop_size["height"], self.config.crop_size["width"]
        height, width = pixels.shape[:2]
        if height < crop_h or width < crop_w:
            new_h, new_w = max(height, crop_h), max(width, crop_w)
            padded = np.zeros((new_h, new_w, pixels.shape[2]), dtype=pixels.dtype)
            top, left = -(-(new_h - height) // 2), -(-(new_w - width) // 2)
            padded[top : top + height, left : left + width] = pixels
            pixels, height, width = padded, new_h, new_w
        top, left = (height - crop_h) // 2, (width - crop_w) // 2
        return pixels[top : top + crop_h, left : left + crop_w]

    def preprocess(self, image: Image.Image) -> torch.Tensor:
        """One image -> [3, H, W] float32."""
        cfg = self.config
        if cfg.do_convert_rgb or image.mode != "RGB":
            image = _to_rgb(image)
        if cfg.do_resize:
            image = self._resize(image)
        pixels = np.array(image)  # [H, W, 3] uint8, a writable copy
        if cfg.do_center_crop:
            pixels = self._center_crop(pixels)
        tensor = torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1).float()
        if cfg.do_rescale:
            tensor = tensor * cfg.rescale_factor
        if cfg.do_normalize:
            tensor = (tensor - self._mean) / self._std
        return tensor.contiguous()  # [3, H, W]

    def __call__(self, images: Sequence[Image.Image]) -> list[torch.Tensor]:
        return [self.preprocess(image) for image in images]


def num_image_tokens(model_config: dict[str, Any]) -> int:
    """Placeholder tokens one image expands to in a LLaVA-style config.json."""
    if "image_seq_length" in model_config:
        return int(model_config["image_seq_length"])
    vision = model_config["vision_config"]
    num_patches = (vision["image_size"] // vision["patch_size"]) ** 2
    strategy = model_config.get("vision_feature_select_strategy", "default")
    return num_patches + (1 if strategy == "full" else 0)


def expand_image_placeholders(
    token_ids: Sequence[int],
    image_token_id: int,
    num_image_tokens: int,
    images: Sequence[torch.Tensor | None],
    hashes: Sequence[str],
) -> tuple[list[int], list[MultiModalFeature]]:
    """Expand each image token of the prompt into `num_image_tokens` copies, in order, and
    describe each run as a MultiModalFeature (hash, offset, length, pixels)."""
    num_placeholders = sum(1 for t in token_ids if t == image_token_id)
    if num_placeholders != len(images):
        raise ValueError(
            f"prompt has {num_placeholders} image placeholder(s) but {len(images)} image(s) "
            "were given"
        )
    if len(hashes) != len(images):
        raise ValueError(f"got {len(hashes)} hash(es) for {len(images)} image(s)")
    if num_image_tokens < 1:
        raise ValueError("num_image_tokens must be >= 1")
    expanded: list[int] = []
    features: list[MultiModalFeature] = []
    for token_id in token_ids:
        if token_id != image_token_id:
            expanded.append(token_id)
            continue
        index = len(features)
        features.append(
            MultiModalFeature(hashes[index], len(expanded), num_image_tokens, images[index])
        )
        expanded.extend([image_token_id] * num_image_tokens)
    return expanded, features
