"""Small corpora with known texts: two text sources (code, prose), and a text source
with an image+text one (parquet with an image column, or webdataset shards)."""

from __future__ import annotations

import io
import json
import os
import tarfile
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from msd_dask.formats import Unit, get_format
from msd_dask.sources.storage import open_source


def _text(rng: np.random.Generator, tag: str, long_tail: bool) -> str:
    n = int(rng.lognormal(5.0, 1.2)) if long_tail else int(rng.integers(1, 300))
    words = ["alpha", "béta", "γάμμα", "delta", "ε", "zeta 🙂", "eta\n", "theta\t"]
    body = " ".join(words[int(i)] for i in rng.integers(0, len(words), size=max(n // 5, 0)))
    return f"{tag}: {body}"


def write_corpus(root: str, *, seed: int = 0, code_files: int = 4, code_rows: int = 20,
                 prose_files: int = 3, prose_rows: int = 30) -> dict[tuple[str, str], str]:
    """Write ``root/code/*.parquet`` and ``root/prose/*.jsonl.zst``.

    Returns ``{(source, key): text}`` with keys as the service reports them.
    """
    rng = np.random.default_rng(seed)
    texts: dict[tuple[str, str], str] = {}
    os.makedirs(f"{root}/code", exist_ok=True)
    os.makedirs(f"{root}/prose", exist_ok=True)
    for f in range(code_files):
        rows = [_text(rng, f"code {f}/{i}", True) for i in range(code_rows)]
        pq.write_table(pa.table({"text": rows, "id": list(range(code_rows))}),
                       f"{root}/code/part-{f}.parquet", row_group_size=7)
        for i, t in enumerate(rows):
            texts[("code", f"part-{f}.parquet:{i}")] = t
    for f in range(prose_files):
        buf = io.StringIO()
        for i in range(prose_rows):
            t = _text(rng, f"prose {f}/{i}", False)
            buf.write(json.dumps({"text": t}) + "\n")
            texts[("prose", f"part-{f}.jsonl.zst:{i}")] = t
        with open(f"{root}/prose/part-{f}.jsonl.zst", "wb") as fh:
            fh.write(zstandard.ZstdCompressor().compress(buf.getvalue().encode()))
    return texts


def config(root: str, **overrides: Any) -> dict[str, Any]:
    """A service config over :func:`write_corpus`'s output."""
    cfg: dict[str, Any] = {
        "name": "itest",
        "seed": 7,
        "parallel": {"dp": 2},
        "batch": {"seq_len": 512, "micro_batches": 2},
        # the defaults: rounds of prefetch - 1 = 3 steps (one message per role and round)
        "prefetch": 4,
        "timeout": 60,
        "sources": [
            {"name": "code", "uri": f"{root}/code/*.parquet", "format": "parquet",
             "weight": 0.7, "loaders": 2, "shuffle_window": 2},
            {"name": "prose", "uri": f"{root}/prose/*.jsonl.zst", "format": "jsonl",
             "weight": 0.3},
        ],
    }
    cfg.update(overrides)
    return cfg


def source_units(src: Any) -> tuple[Any, list[Unit]]:
    """The filesystem of a source (a ``SourceConfig``) and its units, file by file as its
    format lists them."""
    files = open_source(src.uri, src.storage_options)
    fmt = get_format(src.format)
    return files.fs, [u for p in files.paths for u in fmt.units(files.fs, p)]



def train_bpe(texts: list[str], path: str, vocab: int = 400, pad: bool = True) -> str:
    """A small byte-level BPE ``tokenizer.json`` trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<pad>"] if pad else ["</s>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.save(path)
    return path


# ---------------------------------------------------------------------------------------
# Images and text
# ---------------------------------------------------------------------------------------

IMAGE_SIZE, IMAGE_PATCH = 32, 8
N_IMG = (IMAGE_SIZE // IMAGE_PATCH) ** 2  # 16 image tokens per image
IMAGE_SEQ_LEN = 256


def image_bytes(rng: np.random.Generator, i: int) -> bytes:
    """A small deterministic image: noise over a gradient, odd sizes, PNG or JPEG."""
    from PIL import Image

    h, w = int(rng.integers(20, 70)), int(rng.integers(20, 70))
    yy, xx = np.mgrid[0:h, 0:w]
    arr = np.stack([xx * 255 // w, yy * 255 // h, np.full((h, w), i * 37 % 256)], -1)
    arr = (arr + rng.integers(0, 40, size=(h, w, 3))).clip(0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG" if i % 2 else "JPEG", quality=90)
    return buf.getvalue()


def _caption(rng: np.random.Generator, tag: str) -> str:
    words = ["a", "cat", "on", "the", "mat", "çà", "画像", "🙂"]
    n = int(rng.integers(1, 60))
    return f"{tag}: " + " ".join(words[int(i)] for i in rng.integers(0, len(words), size=n))


def write_image_corpus(root: str, kind: str, seed: int = 0) -> tuple[dict, dict]:
    """A text source ``root/text/*.parquet`` and an image+text source ``root/vis/``.

    Returns ``(texts, images)`` keyed by ``(source, key)`` as the service reports them.
    """
    rng = np.random.default_rng(seed)
    texts: dict[tuple[str, str], str] = {}
    images: dict[tuple[str, str], bytes | None] = {}
    os.makedirs(f"{root}/text", exist_ok=True)
    os.makedirs(f"{root}/vis", exist_ok=True)
    for f in range(2):
        rows = [_caption(rng, f"text {f}/{i}") * (4 if i % 8 == 0 else 1) for i in range(25)]
        pq.write_table(pa.table({"text": rows}), f"{root}/text/t{f}.parquet", row_group_size=10)
        texts.update({("text", f"t{f}.parquet:{i}"): t for i, t in enumerate(rows)})
    for f in range(3):
        caps = [_caption(rng, f"vis {f}/{i}") for i in range(12)]
        # one row without an image (a text document of the image+text source)
        imgs = [None if (f, i) == (0, 5) else image_bytes(rng, 12 * f + i) for i in range(12)]
        if kind == "parquet":
            name = f"v{f}.parquet"
            pq.write_table(pa.table({"caption": caps, "jpg": pa.array(imgs, pa.binary())}),
                           f"{root}/vis/{name}", row_group_size=5)
        else:
            name = f"v{f}.tar"
            imgs[5] = imgs[5] or image_bytes(rng, 99)  # webdataset: every sample has one
            with tarfile.open(f"{root}/vis/{name}", "w") as tar:
                for i, (cap, img) in enumerate(zip(caps, imgs, strict=True)):
                    ext = "jpg" if img is not None and img[:2] == b"\xff\xd8" else "png"
                    assert img is not None
                    for e, data in ((ext, img), ("txt", cap.encode()),
                                    ("json", json.dumps({"i": i}).encode())):
                        info = tarfile.TarInfo(f"{f:02d}/{i:05d}.{e}")
                        info.size = len(data)
                        tar.addfile(info, io.BytesIO(data))
        for i, (cap, img) in enumerate(zip(caps, imgs, strict=True)):
            texts[("vis", f"{name}:{i}")] = cap
            images[("vis", f"{name}:{i}")] = img
    return texts, images


def image_config(root: str, kind: str) -> dict[str, Any]:
    vis: dict[str, Any] = {"name": "vis", "weight": 0.4, "shuffle_window": 2,
                           "image": {"size": IMAGE_SIZE, "patch": IMAGE_PATCH}}
    if kind == "parquet":
        vis.update(uri=f"{root}/vis/*.parquet", format="parquet", text_field="caption",
                   image_field="jpg")
    else:
        vis.update(uri=f"{root}/vis/*.tar", format="webdataset")
    return {
        "name": f"mm-{kind}", "seed": 3, "parallel": {"dp": 2},
        "batch": {"seq_len": IMAGE_SEQ_LEN, "micro_batches": 2}, "prefetch": 2, "timeout": 60,
        "sources": [{"name": "text", "uri": f"{root}/text/*.parquet", "format": "parquet",
                     "weight": 0.6}, vis],
    }


def expected_patches(data: bytes) -> np.ndarray:
    """The patches of an image: our own Pillow path, independent of msd_dask.sources.vision."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        rgb = img.convert("RGB").resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BICUBIC)
    arr = np.asarray(rgb)
    g, p = IMAGE_SIZE // IMAGE_PATCH, IMAGE_PATCH
    return np.stack([arr[y * p:(y + 1) * p, x * p:(x + 1) * p].reshape(-1)
                     for y in range(g) for x in range(g)])
