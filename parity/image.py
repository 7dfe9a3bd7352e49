"""Image preprocessing for K3's vision tower, from the checkpoint's `preprocessor_config.json`; one function for both
engines (the rollout model's inputs are checked against it, `tests/fidelity/test_vision_fidelity.py`).

The scheme is K3's (`vllm/transformers_utils/processors/kimi_k25_vision_fused.py`, `KimiK25FusedVisionProcessor`, and
`vllm/models/kimi_k3/common/mm_preprocess.py`): scale the image down (never up) so that it has at most
`in_patch_limit` patches and at most `patch_limit_on_one_side` per side, resize it (PIL bicubic) to the truncated
size, pad right and bottom with black to a multiple of merge x patch, normalise each channel through the 8-bit table
(v / 255 - mean) / std in fp32, and cut row-major patches [N, 3, p, p]. Images enter upright and in RGB, by vLLM's
rules (`to_rgb`).
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from parity.config import ModelConfig
from parity.io.chat_format import IMAGE_PLACEHOLDER  # where an image goes in a prompt: one token per image
from parity.kernels import Kernels
from parity.vision import ImageInputs, ImagePatches, ImageRows, vision_tower

PREPROCESSOR_FILE = "preprocessor_config.json"
# Modes with 8-bit channels that convert to RGB without losing range; 16-bit, 32-bit and float images do not.
ACCEPTED_MODES = ("1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr", "La", "RGBa")
WHITE = (255, 255, 255)


class ImageError(ValueError):
    """An image zerokl cannot use; the message names it and says why."""


def to_rgb(image: Image.Image, name: str = "image") -> Image.Image:
    """`image` as vLLM's parser hands it to the processor (`vllm.multimodal.parse`: `normalize_image`, then
    `convert_image_mode(.., "RGB")`): turned upright by its EXIF orientation, then in RGB (transparency composited on
    white, anything else `convert`ed); an image whose mode is not 8-bit per channel is refused."""
    if image.mode not in ACCEPTED_MODES:
        raise ImageError(f"{name}: mode {image.mode} is not an 8-bit image mode (accepted: {', '.join(ACCEPTED_MODES)})")
    with contextlib.suppress(Exception):  # vLLM's `normalize_image` ignores a broken EXIF block the same way
        image = ImageOps.exif_transpose(image)
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image if image.mode == "RGBA" else image.convert("RGBA")
        out = Image.new("RGB", rgba.size, WHITE)
        out.paste(rgba, mask=rgba.split()[3])
        return out
    return image.convert("RGB")


def open_image(path: str | Path) -> Image.Image:
    """Read an image file fully into memory, in RGB (`to_rgb`); a missing or unreadable file is an `ImageError`."""
    p = Path(path)
    try:
        with Image.open(p) as im:
            im.load()
            return to_rgb(im, str(p))
    except FileNotFoundError:
        raise ImageError(f"{p}: no such image file") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        if isinstance(e, ImageError):
            raise
        raise ImageError(f"{p}: not a readable image ({e})") from None


@dataclass(frozen=True)
class ImageProcessing:
    """The `media_proc_cfg` of `preprocessor_config.json`."""

    patch_size: int
    merge: int
    in_patch_limit: int
    side_limit: int  # patches on one side
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ImageProcessing:
        cfg = raw.get("media_proc_cfg", raw)
        if cfg.get("fixed_output_tokens") is not None:
            raise ImageError("preprocessor_config.json: fixed_output_tokens is not supported")
        merge = cfg["merge_kernel_size"]
        return cls(int(cfg["patch_size"]), int(merge[0] if isinstance(merge, list) else merge),
                   int(cfg["in_patch_limit"]), int(cfg["patch_limit_on_one_side"]),
                   tuple(float(v) for v in cfg["image_mean"]), tuple(float(v) for v in cfg["image_std"]))

    @classmethod
    def from_checkpoint(cls, ckpt: str | Path) -> ImageProcessing:
        path = Path(ckpt) / PREPROCESSOR_FILE
        if not path.is_file():
            raise ImageError(f"{ckpt} has no {PREPROCESSOR_FILE}: it takes no images")
        return cls.from_dict(json.loads(path.read_text()))

    def plan(self, width: int, height: int) -> tuple[int, int, int, int]:
        """(new width, new height, padded width, padded height) in pixels for an image of this size."""
        p = self.patch_size
        s1 = math.sqrt(self.in_patch_limit / (max(1.0, width // p) * max(1.0, height // p)))
        scale = min(1.0, s1, self.side_limit * p / width, self.side_limit * p / height)
        new_w = min(max(1, int(width * scale)), self.side_limit * p)
        new_h = min(max(1, int(height * scale)), self.side_limit * p)
        factor = self.merge * p
        return new_w, new_h, new_w + (factor - new_w % factor) % factor, new_h + (factor - new_h % factor) % factor

    def num_tokens(self, image: Image.Image) -> int:
        """How many placeholder rows the image fills in a prompt (merged patches)."""
        _, _, pw, ph = self.plan(*image.size)
        f = self.merge * self.patch_size
        return (pw // f) * (ph // f)

    def _table(self) -> np.ndarray:
        """[256, 3] fp32: the normalised value of each 8-bit level per channel (the fused processor's table)."""
        values = np.arange(256, dtype=np.float32)[:, None]
        mean = np.asarray(self.mean, dtype=np.float32)
        std_inv = 1.0 / np.asarray(self.std, dtype=np.float32)
        return (values / 255.0 - mean[None, :]) * std_inv[None, :]

    def __call__(self, image: Image.Image) -> ImagePatches:
        """An RGB image -> its normalised patches and grid (one frame)."""
        if image.mode != "RGB":
            raise ImageError(f"preprocess takes RGB images (see to_rgb), got mode {image.mode}")
        p = self.patch_size
        new_w, new_h, pw, ph = self.plan(*image.size)
        pixels = np.zeros((ph, pw, 3), dtype=np.uint8)  # padding is level 0
        pixels[:new_h, :new_w] = np.asarray(image.resize((new_w, new_h), resample=Image.Resampling.BICUBIC))
        values = self._table()[pixels, np.arange(3)]  # [ph, pw, 3]
        gh, gw = ph // p, pw // p
        patches = values.reshape(gh, p, gw, p, 3).transpose(0, 2, 4, 1, 3).reshape(gh * gw, 3, p, p)
        return ImagePatches(torch.from_numpy(np.ascontiguousarray(patches)), (1, gh, gw), (self.merge, self.merge))


class ImageEncoder:
    """A trainer's images: each preprocessed (`ImageProcessing`) once per image object, and run through the
    checkpoint's vision tower as loaded (frozen: no gradient) on a kernel set, once per image object; what the engine
    computes for it, bit for bit. A trainer that trains the tower takes the patches (`inputs`) instead."""

    def __init__(self, checkpoint: str | Path, cfg: ModelConfig, tensors: dict[str, torch.Tensor], kernels: Kernels):
        self.processing = ImageProcessing.from_checkpoint(checkpoint)
        self.tower = vision_tower(cfg, tensors, kernels, self.processing.side_limit)
        self.token_id = int(cfg.raw["media_placeholder_token_id"])
        self._patches: dict[int, tuple[Image.Image, ImagePatches]] = {}
        self._done: dict[int, tuple[ImagePatches, torch.Tensor]] = {}  # by id of the patches (held with them)

    def inputs(self, images: list[tuple[Image.Image, ...]]) -> ImageInputs:
        """`ImageInputs` of a batch whose row b holds `images[b]` (in prompt order)."""
        return ImageInputs(self.token_id, tuple(tuple(self.patches(im) for im in row) for row in images))

    def rows(self, images: list[tuple[Image.Image, ...]] | ImageInputs) -> ImageRows:
        """`ImageRows` (the frozen tower's) of a batch whose row b holds `images[b]`, or of these inputs."""
        inputs = images if isinstance(images, ImageInputs) else self.inputs(images)
        return ImageRows(self.token_id, tuple(tuple(self._embed(p) for p in row) for row in inputs.rows))

    def patches(self, image: Image.Image) -> ImagePatches:
        """One image preprocessed (kept while the image object lives in this encoder)."""
        if id(image) not in self._patches:
            self._patches[id(image)] = (image, self.processing(image))
        return self._patches[id(image)][1]

    def embed(self, image: Image.Image) -> torch.Tensor:
        """One image's merged-token embeddings [tokens, D] from the frozen tower."""
        return self._embed(self.patches(image))

    def _embed(self, patches: ImagePatches) -> torch.Tensor:
        if id(patches) not in self._done:
            with torch.no_grad():
                self._done[id(patches)] = (patches, self.tower(patches))
        return self._done[id(patches)][1]

    def forget(self) -> None:
        """Drop the patches and embeddings kept so far (a new batch of images)."""
        self._patches.clear()
        self._done.clear()
