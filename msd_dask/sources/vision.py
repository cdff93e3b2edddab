"""Images of image+text documents: decode, resize, cut into patches (pure, Pillow).

Every step is deterministic: the same bytes give the same patches on every
worker.  An image becomes ``size × size`` RGB pixels (Pillow's bicubic resize,
aspect ratio not kept), then ``(size / patch)²`` patches of ``patch × patch``
pixels in row-major order; each patch is flattened in ``(y, x, channel)``
order, so one patch is a row of ``patch · patch · 3`` ``uint8`` values.
"""

from __future__ import annotations

import io
import re
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["IMAGE_FORMATS", "decode_image", "resize", "patchify", "unpatchify", "image_patches",
           "num_patches"]


#: the raster formats :func:`decode_image` reads (Pillow's names); others are refused as
#: undecodable: Pillow would hand EPS to Ghostscript, and its rarer plugins raise
#: exceptions of their own on damaged data
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF", "PPM")


def decode_image(data: bytes) -> Image.Image:
    """The image encoded in ``data`` (one of :data:`IMAGE_FORMATS`), as RGB, turned upright
    as its EXIF orientation says (a phone's photo, stored sideways with an orientation tag,
    came out sideways: viewers, and Hugging Face ``datasets``, turn it; a review).

    Raises
    ------
    ValueError
        If ``data`` is not an image of those formats Pillow can decode: whatever Pillow
        raises on damaged data (its plugins raise ``NotImplementedError``, ``IndexError``,
        ``struct.error`` ... as well as ``OSError``) is this one error, which the reader
        reports as the row's bad input.
    """
    from PIL import Image, ImageOps  # here: only processes that decode images load Pillow

    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as img:
            img.load()
            # (a TIFF's 0 for white: Pillow turns an 8-bit one, not a 16-bit one, which came
            # out as its negative; a review)
            white_is_0 = img.format == "TIFF" and getattr(img, "tag_v2", {}).get(262) == 0
            ImageOps.exif_transpose(img, in_place=True)  # (no copy of a large image; a review)
            return _eight_bit(img, img.format, white_is_0).convert("RGB")
    except (MemoryError, RecursionError):
        # (the process's, not the data's: a valid image was quarantined as bad input; a
        # review)
        raise
    except Exception as exc:  # noqa: BLE001 - any failure to decode is the row's bad input
        # (Pillow names the file object it read: an address, other in every run)
        reason = re.sub(r" <_io\.BytesIO object at 0x[0-9a-f]+>", "", str(exc))
        raise ValueError(f"cannot decode image ({len(data)} bytes): "
                         f"{type(exc).__name__}: {reason}") from None


def _eight_bit(img: Image.Image, fmt: str | None, white_is_0: bool = False) -> Image.Image:
    """``img``, a 16-bit grayscale image (a PNG's or TIFF's ``I;16``, or ``I`` holding values
    past 255) scaled to 8 bits: Pillow's conversion to RGB clips it instead, all but its
    darkest pixels white.  ``fmt``: the format it was decoded from; ``white_is_0``: a
    TIFF's photometric interpretation says 0 is white (its 16 bits are turned).  An ``I``
    image of values up to 255 (a 32-bit TIFF of 8-bit values) is left as it is, but not a
    PGM's: Pillow opens a 16-bit PGM as ``I`` scaled to 16 bits whatever its values, so a
    dark one came out up to 257 times too bright, where the same pixels in a 16-bit PNG
    came out right (a review).  In the image's own 16 or 32 bits, no wider copy (int64
    copies took a 169-megapixel image to 10 times its pixels' memory; a review)."""
    from PIL import Image

    if img.mode not in ("I", "I;16", "I;16L", "I;16B", "I;16N"):
        return img
    values = np.asarray(img)
    if img.mode == "I":
        if fmt != "PPM" and (values.size == 0 or int(values.max()) <= 255):
            return img
        values = np.clip(values, 0, 65535)
    elif white_is_0:
        values = np.subtract(65535, values, dtype=values.dtype)
    return Image.fromarray((values // 257).astype(np.uint8), "L")


def resize(img: Image.Image, size: int) -> np.ndarray:
    """``img`` resized to ``size × size`` (bicubic), as ``uint8 [size, size, 3]``."""
    from PIL import Image

    if img.size != (size, size):
        img = img.resize((size, size), Image.Resampling.BICUBIC)
    return np.asarray(img.convert("RGB"), dtype=np.uint8)


def patchify(pixels: np.ndarray, patch: int) -> np.ndarray:
    """Cut ``[H, W, C]`` pixels into ``[(H/patch)·(W/patch), patch·patch·C]`` patches.

    Patches are in row-major order over the image; each is flattened ``(y, x, c)``.
    """
    h, w, c = pixels.shape
    if h % patch or w % patch:
        raise ValueError(f"image of {h}x{w} is not divisible into {patch}x{patch} patches")
    grid = pixels.reshape(h // patch, patch, w // patch, patch, c).transpose(0, 2, 1, 3, 4)
    return np.ascontiguousarray(grid.reshape(-1, patch * patch * c))


def unpatchify(patches: np.ndarray, size: int, patch: int, channels: int = 3) -> np.ndarray:
    """The inverse of :func:`patchify` for a ``size × size`` image."""
    g = size // patch
    grid = np.asarray(patches).reshape(g, g, patch, patch, channels).transpose(0, 2, 1, 3, 4)
    return grid.reshape(size, size, channels)


def num_patches(size: int, patch: int) -> int:
    """Image tokens of one image: ``(size / patch)²``."""
    return (size // patch) ** 2


def image_patches(data: bytes, size: int, patch: int) -> np.ndarray:
    """``patchify(resize(decode_image(data), size), patch)``: what a loader keeps of an image."""
    return patchify(resize(decode_image(data), size), patch)
