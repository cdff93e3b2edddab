"""Image+text sources: decode/resize/patchify, the webdataset reader, and the service end to end.

The service test mixes a text source with an image+text source (parquet with an image
bytes column, or webdataset tar shards) and checks that every delivered image document's
``pixel_values`` are the patches of its own stored image, decoded and resized.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections import defaultdict
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from msd_dask import DataService, load_config
from msd_dask.core.packing import IGNORE_INDEX, pack_rows
from msd_dask.errors import ConfigError, DataError
from msd_dask.formats import get_format
from msd_dask.sources.documents import ImageDoc, read_unit
from msd_dask.sources.tokenizer import IMG, ByteTokenizer
from msd_dask.sources.vision import decode_image, image_patches, patchify, resize, unpatchify

from checks import check_exactly_once, shares

SIZE, PATCH = 32, 8
N_IMG = (SIZE // PATCH) ** 2  # 16 image tokens per image
SEQ_LEN = 256


def _image_bytes(rng: np.random.Generator, i: int) -> bytes:
    """A small deterministic image: noise over a gradient, odd sizes, PNG or JPEG."""
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


def write_corpus(root: str, kind: str, seed: int = 0) -> tuple[dict, dict]:
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
        imgs = [None if (f, i) == (0, 5) else _image_bytes(rng, 12 * f + i) for i in range(12)]
        if kind == "parquet":
            name = f"v{f}.parquet"
            pq.write_table(pa.table({"caption": caps, "jpg": pa.array(imgs, pa.binary())}),
                           f"{root}/vis/{name}", row_group_size=5)
        else:
            name = f"v{f}.tar"
            imgs[5] = imgs[5] or _image_bytes(rng, 99)  # webdataset: every sample has one
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


def config(root: str, kind: str) -> dict[str, Any]:
    vis: dict[str, Any] = {"name": "vis", "weight": 0.4, "shuffle_window": 2,
                           "image": {"size": SIZE, "patch": PATCH}}
    if kind == "parquet":
        vis.update(uri=f"{root}/vis/*.parquet", format="parquet", text_field="caption",
                   image_field="jpg")
    else:
        vis.update(uri=f"{root}/vis/*.tar", format="webdataset")
    return {
        "name": f"mm-{kind}", "seed": 3, "parallel": {"dp": 2},
        "batch": {"seq_len": SEQ_LEN, "micro_batches": 2}, "prefetch": 2, "timeout": 60,
        "sources": [{"name": "text", "uri": f"{root}/text/*.parquet", "format": "parquet",
                     "weight": 0.6}, vis],
    }


def _expected_patches(data: bytes) -> np.ndarray:
    # our own Pillow path, independent of msd_dask.sources.vision
    with Image.open(io.BytesIO(data)) as img:
        rgb = img.convert("RGB").resize((SIZE, SIZE), Image.Resampling.BICUBIC)
    arr = np.asarray(rgb)
    g = SIZE // PATCH
    return np.stack([arr[y * PATCH:(y + 1) * PATCH, x * PATCH:(x + 1) * PATCH].reshape(-1)
                     for y in range(g) for x in range(g)])


# ---------------------------------------------------------------------------------------
# Pure pieces
# ---------------------------------------------------------------------------------------

def test_patchify_round_trip_and_layout() -> None:
    rng = np.random.default_rng(1)
    px = rng.integers(0, 256, size=(SIZE, SIZE, 3), dtype=np.uint8)
    p = patchify(px, PATCH)
    assert p.shape == (N_IMG, PATCH * PATCH * 3) and p.dtype == np.uint8
    np.testing.assert_array_equal(p[1].reshape(PATCH, PATCH, 3), px[:PATCH, PATCH:2 * PATCH])
    np.testing.assert_array_equal(unpatchify(p, SIZE, PATCH), px)
    with pytest.raises(ValueError, match="not divisible"):
        patchify(px[:30], PATCH)
    data = _image_bytes(rng, 0)
    np.testing.assert_array_equal(image_patches(data, SIZE, PATCH), _expected_patches(data))
    assert resize(decode_image(data), SIZE).shape == (SIZE, SIZE, 3)
    with pytest.raises(ValueError, match="cannot decode image"):
        decode_image(b"not an image")


def test_config_keys_and_errors(tmp_path: Any) -> None:
    write_corpus(str(tmp_path), "parquet")
    cfg = config(str(tmp_path), "parquet")
    loaded = load_config(cfg)
    vis = loaded.source("vis")
    assert vis.image_field == "jpg" and vis.image is not None and vis.image.tokens == N_IMG
    assert load_config(loaded.to_dict()).source("vis") == vis  # round trip
    assert loaded.source("text").image is None

    def bad(key: str, **change: Any) -> None:
        c = config(str(tmp_path), "parquet")
        c["sources"][1].update(change)
        with pytest.raises(ConfigError, match=key):
            load_config(c)

    bad(r"sources\[1\]\.image\.patch", image={"size": 30, "patch": 8})
    bad(r"sources\[1\]\.image\.size", image={"size": 0})
    bad(r"sources\[1\]\.image\.shape", image={"shape": 3})
    bad(r"sources\[1\]\.image'", image={"size": 512, "patch": 8})  # 4096 tokens > seq_len
    bad(r"sources\[1\]\.image_field", image_field="caption")
    c = config(str(tmp_path), "parquet")
    c["sources"][0].update(image_field="x", image={"size": 32, "patch": 16})
    with pytest.raises(ConfigError, match=r"sources\[1\]\.image\.patch"):
        load_config(c)
    # the image field alone gives the defaults: 224 px, patches of 14
    c = config(str(tmp_path), "parquet")
    del c["sources"][1]["image"]
    c["batch"]["seq_len"] = 512
    assert load_config(c).source("vis").image.tokens == 256


def test_webdataset_groups_members_by_key(tmp_path: Any) -> None:
    _, images = write_corpus(str(tmp_path), "webdataset")
    fmt, fs = get_format("webdataset"), __import__("fsspec").filesystem("file")
    path = f"{tmp_path}/vis/v1.tar"
    rows = list(fmt.read(fs, fmt.units(fs, path)[0], ["text", "image", "i"]))
    assert [r for r, _ in rows] == list(range(12))
    assert [rec["i"] for _, rec in rows] == list(range(12))
    assert all(rec["image"] == images[("vis", f"v1.tar:{r}")] for r, rec in rows)
    # a shard cut at a member boundary has lost its end block: an error, not fewer rows
    data = open(path, "rb").read()
    with tarfile.open(path) as tar:
        cut = tar.getmembers()[3].offset  # the second sample's first header
    fs.pipe_file(path, data[:cut])
    with pytest.raises(DataError, match="truncated tar"):
        list(fmt.read(fs, fmt.units(fs, path)[0], ["text"]))


def test_read_unit_puts_image_tokens_first(tmp_path: Any) -> None:
    texts, images = write_corpus(str(tmp_path), "parquet")
    cfg = load_config(config(str(tmp_path), "parquet"))
    src = cfg.source("vis")
    fmt, fs = get_format("parquet"), __import__("fsspec").filesystem("file")
    path = f"{tmp_path}/vis/v0.parquet"
    docs = [d for u in fmt.units(fs, path) for d in read_unit(src, fs, u, ByteTokenizer())]
    tok = ByteTokenizer()
    for i, d in enumerate(docs):
        text = tok.encode(texts[("vis", f"v0.parquet:{i}")])
        img = images[("vis", f"v0.parquet:{i}")]
        if img is None:
            assert isinstance(d, np.ndarray)
            np.testing.assert_array_equal(d, text)
            continue
        assert isinstance(d, ImageDoc) and len(d) == N_IMG + len(text)
        assert (d.tokens[:N_IMG] == IMG).all()
        np.testing.assert_array_equal(d.tokens[N_IMG:], text)
        np.testing.assert_array_equal(d.patches, _expected_patches(img))
    # a chunked document: the image travels with the chunk holding its tokens
    d = docs[0]
    assert isinstance(d, ImageDoc)
    toks, pt = d.piece(0, 10)
    assert len(toks) == 11 and len(pt) == 10
    toks, pt = d.piece(N_IMG, len(d))
    assert len(pt) == 0
    # labels never target an image token
    packed = pack_rows([[(d.piece(0, len(d)), len(d))]], SEQ_LEN, tok.pad_id)
    assert (packed["labels"][0, :N_IMG - 1] == IGNORE_INDEX).all()
    assert packed["labels"][0, N_IMG - 1] == d.tokens[N_IMG]
    assert packed["image_spans"] == [[(0, N_IMG)]]


# ---------------------------------------------------------------------------------------
# The service
# ---------------------------------------------------------------------------------------

@pytest.mark.integration
@pytest.mark.parametrize("kind", ["parquet", "webdataset"])
def test_service_delivers_pixel_values_of_listed_documents(tmp_path: Any, kind: str) -> None:
    root = str(tmp_path)
    texts, images = write_corpus(root, kind)
    tok = ByteTokenizer()
    cfg = config(root, kind)
    records = []
    with DataService.start(cfg, n_workers=2, threads_per_worker=1) as svc:
        readers = [svc.reader(r) for r in range(2)]
        for step in range(25):
            for reader in readers:
                b = next(reader)
                assert b.step == step
                records.append({
                    "input_ids": b.input_ids.numpy(), "labels": b.labels.numpy(),
                    "cu_seqlens": [c.numpy() for c in b.cu_seqlens],
                    "documents": b.documents, "epochs": b.epochs,
                    "pixel_values": None if b.pixel_values is None else b.pixel_values.numpy(),
                    "image_spans": b.image_spans})
    expected_cache: dict[tuple[str, str], np.ndarray] = {}
    tokens: dict[str, int] = defaultdict(int)
    images_seen = 0
    for rec in records:
        pv, spans = rec["pixel_values"], rec["image_spans"]
        next_patch = 0
        for m, docs in enumerate(rec["documents"]):
            cu = rec["cu_seqlens"][m]
            for j, (src, key, chunk) in enumerate(docs):
                a, b_ = int(cu[j]), int(cu[j + 1])
                seg = rec["input_ids"][m, a:b_]
                tokens[src] += b_ - a
                img = images.get((src, key))
                span = None if spans is None else spans[m][j]
                text = tok.encode(texts[(src, key)])
                if img is None or chunk > 0:
                    assert span is None, (src, key)
                    full = text if img is None else np.concatenate(
                        [np.full(N_IMG, IMG, np.int32), text])
                    np.testing.assert_array_equal(seg, full[chunk * SEQ_LEN:][:b_ - a])
                    continue
                # an image document: its patches, then its text
                assert span == (next_patch, N_IMG), (key, span)
                if (src, key) not in expected_cache:
                    expected_cache[(src, key)] = _expected_patches(img)
                np.testing.assert_array_equal(pv[next_patch:next_patch + N_IMG],
                                              expected_cache[(src, key)], err_msg=key)
                next_patch += N_IMG
                images_seen += 1
                assert (seg[:N_IMG] == IMG).all()
                if b_ - a == N_IMG + len(text):  # the whole document: its text decodes back
                    assert tok.decode(seg[N_IMG:]) == texts[(src, key)]
                np.testing.assert_array_equal(seg[N_IMG:], text[:b_ - a - N_IMG])
                assert (rec["labels"][m, a:a + N_IMG - 1] == IGNORE_INDEX).all()
        assert next_patch == (0 if pv is None else len(pv))
        # patch i stands for the i-th image token of the batch, row by row
        assert int((rec["input_ids"] == IMG).sum()) == next_patch
    assert images_seen > 30
    # the mix counts image tokens: token shares follow the weights
    got = shares(dict(tokens))
    assert abs(got["vis"] - 0.4) < 0.03, got
    # exactly once per source epoch, chunks counted with image tokens included
    lengths = {k: len(tok.encode(t)) + (N_IMG if images.get(k) is not None else 0)
               for k, t in texts.items()}
    epochs = check_exactly_once(records, {k: "x" * (n - 1) for k, n in lengths.items()},
                                SEQ_LEN)
    assert epochs["vis"] >= 1 and epochs["text"] >= 1, epochs
