"""Image+text sources: decode/resize/patchify, the config, the webdataset reader, a unit's documents.

The corpus (a text source and an image+text one) is ``tests/corpus.py``'s; the service end
to end is ``tests/integration/test_multimodal_service.py``.
"""

from __future__ import annotations

import re
import tarfile
from typing import Any

import numpy as np
import pytest

from msd_dask import load_config
from msd_dask.core.packing import IGNORE_INDEX, pack_rows
from msd_dask.errors import ConfigError, DataError
from msd_dask.formats import get_format
from msd_dask.sources.documents import ImageDoc, read_unit
from msd_dask.sources.tokenizer import IMG, ByteTokenizer
from msd_dask.sources.vision import decode_image, image_patches, patchify, resize, unpatchify

from corpus import IMAGE_PATCH as PATCH
from corpus import IMAGE_SEQ_LEN as SEQ_LEN
from corpus import IMAGE_SIZE as SIZE
from corpus import N_IMG, expected_patches, image_bytes, image_config, write_image_corpus

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
    data = image_bytes(rng, 0)
    np.testing.assert_array_equal(image_patches(data, SIZE, PATCH), expected_patches(data))
    assert resize(decode_image(data), SIZE).shape == (SIZE, SIZE, 3)
    with pytest.raises(ValueError, match="cannot decode image"):
        decode_image(b"not an image")


#: a damaged DDS texture on which Pillow's DDS plugin raised NotImplementedError ("Unknown
#: pixel format flags 8192"), found by mutating images (a review of the loaders)
DAMAGED_DDS = bytes.fromhex(
    "444453207c0000000f1000002000000028000000780000000000000000000000000000000000000000"
    "000000000000000000000000000000000000631cc1839400000000000000000000000000000000002000"
    "00004000000000000000180000000000ff5b00ff0000ff000000000000000010000000000000000000000"
    "00000005c9c35016871000000000a44a2e8cf04857929ea3a8aba9a00d0eeba08da8adc2c076b4c")


@pytest.mark.parametrize("data", [DAMAGED_DDS, b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 1 1\n"],
                         ids=["damaged-dds", "eps"])
def test_whatever_pillow_raises_on_an_image_is_one_value_error(data: bytes) -> None:
    """An exception outside the caught set (NotImplementedError from a plugin) escaped the
    row's bad-input handling, and the whole shard was lost even under ``on_error: skip``;
    formats other than the common raster ones are not decoded at all (Pillow hands EPS to
    Ghostscript)."""
    with pytest.raises(ValueError, match=r"cannot decode image \(\d+ bytes\): "):
        decode_image(data)


def test_any_exception_of_a_decoder_is_the_rows_bad_input(monkeypatch: pytest.MonkeyPatch) -> None:
    from PIL import Image

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise IndexError("tile out of range")

    monkeypatch.setattr(Image, "open", broken)
    with pytest.raises(ValueError, match="IndexError: tile out of range"):
        decode_image(b"\x89PNG")


def test_a_16_bit_grayscale_image_is_scaled_not_clipped() -> None:
    # Pillow's convert("RGB") clips 16-bit values: a 16-bit gradient came out 99.6% white
    import io

    from PIL import Image

    gradient = np.linspace(0, 65535, 64 * 64).reshape(64, 64).astype(np.uint16)
    out = io.BytesIO()
    Image.fromarray(gradient).save(out, "PNG")
    rgb = np.asarray(decode_image(out.getvalue()))
    assert rgb.shape == (64, 64, 3) and rgb.dtype == np.uint8
    np.testing.assert_array_equal(rgb[..., 0], (gradient // 257).astype(np.uint8))
    assert len(np.unique(rgb)) == 256


def test_a_dark_16_bit_pgm_decodes_as_the_same_pixels_in_a_png() -> None:
    """Pillow opens a 16-bit PGM as mode ``I`` (scaled to 16 bits); the rule that leaves an
    ``I`` image of values up to 255 unscaled took a dark one for 8-bit: up to 257 times too
    bright, where the same pixels in a 16-bit PNG came out right (a review)."""
    import io

    from PIL import Image

    for top in (200, 255, 4000, 65535):
        dark = np.tile(np.linspace(0, top, 16).astype(np.uint16), (16, 1))
        pgm = b"P5 16 16 65535\n" + dark.astype(">u2").tobytes()
        png = io.BytesIO()
        Image.fromarray(dark).save(png, "PNG")
        want = (dark // 257).astype(np.uint8)
        for data in (pgm, png.getvalue()):
            np.testing.assert_array_equal(np.asarray(decode_image(data))[..., 0], want)


@pytest.mark.parametrize("compression", ["raw", "tiff_deflate"])
def test_a_16_bit_tiff_whose_0_is_white_is_not_its_negative(compression: str) -> None:
    # Pillow turns an 8-bit MinIsWhite TIFF, not a 16-bit one, which came out as its
    # negative (a review)
    import io

    from PIL import Image

    stored = np.tile(np.array([0, 16384, 49152, 65535], dtype=np.uint16), (4, 1))
    out = io.BytesIO()
    Image.frombytes("I;16", (4, 4), stored.astype("<u2").tobytes()).save(
        out, "TIFF", compression=compression, tiffinfo={262: 0})
    got = np.asarray(decode_image(out.getvalue()))[..., 0]
    np.testing.assert_array_equal(got, ((65535 - stored) // 257).astype(np.uint8))


def test_running_out_of_memory_is_not_the_images_fault(monkeypatch: pytest.MonkeyPatch) -> None:
    # a valid image that failed for lack of memory was "cannot decode image", and under
    # on_error: skip a good document was quarantined (a review)
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 8)).save(out, "PNG")

    def no_memory(*a: Any, **k: Any) -> Any:
        raise MemoryError

    monkeypatch.setattr(Image, "open", no_memory)
    with pytest.raises(MemoryError):
        decode_image(out.getvalue())


def test_a_photo_with_an_exif_orientation_is_decoded_upright() -> None:
    """A phone stores a portrait photo sideways with an EXIF orientation tag; it came out
    sideways (64 wide, 32 high) where viewers and Hugging Face ``datasets`` show it upright
    (a review of the multimodal path)."""
    import io

    from PIL import Image

    stored = np.zeros((32, 64, 3), dtype=np.uint8)
    stored[:, :32] = 255                        # left half white, as stored
    img = Image.fromarray(stored)
    exif = img.getexif()
    exif[0x0112] = 6                            # orientation: turn 90° clockwise to view
    out = io.BytesIO()
    img.save(out, "JPEG", exif=exif.tobytes(), quality=95)
    rgb = np.asarray(decode_image(out.getvalue()))
    assert rgb.shape == (64, 32, 3)             # upright: 32 wide, 64 high
    assert rgb[:28].mean() > 200 and rgb[36:].mean() < 50  # the white half is on top
    plain = io.BytesIO()
    img.save(plain, "JPEG", quality=95)         # no tag: as stored
    assert np.asarray(decode_image(plain.getvalue())).shape == (32, 64, 3)


def test_a_32_bit_image_of_8_bit_values_is_not_scaled() -> None:
    # (a review of the 16-bit scaling: a 32-bit TIFF of values 0-255 came out black)
    import io

    from PIL import Image

    values = np.arange(256, dtype=np.int32).repeat(16).reshape(64, 64)
    out = io.BytesIO()
    Image.fromarray(values, "I").save(out, "TIFF")
    rgb = np.asarray(decode_image(out.getvalue()))
    assert rgb[..., 0].max() == 255
    np.testing.assert_array_equal(rgb[..., 0], values.astype(np.uint8))


def test_an_undecodable_image_is_said_the_same_in_every_run() -> None:
    # Pillow's message named its file object by address, other in every run
    with pytest.raises(ValueError) as info:
        decode_image(b"not an image at all")
    assert str(info.value) == ("cannot decode image (19 bytes): UnidentifiedImageError: "
                               "cannot identify image file")


def test_config_keys_and_errors(tmp_path: Any) -> None:
    write_image_corpus(str(tmp_path), "parquet")
    cfg = image_config(str(tmp_path), "parquet")
    loaded = load_config(cfg)
    vis = loaded.source("vis")
    assert vis.image_field == "jpg" and vis.image is not None and vis.image.tokens == N_IMG
    assert load_config(loaded.to_dict()).source("vis") == vis  # round trip
    assert loaded.source("text").image is None

    def bad(key: str, **change: Any) -> None:
        c = image_config(str(tmp_path), "parquet")
        c["sources"][1].update(change)
        with pytest.raises(ConfigError, match=key):
            load_config(c)

    bad(r"sources\[1\]\.image\.patch", image={"size": 30, "patch": 8})
    bad(r"sources\[1\]\.image\.size", image={"size": 0})
    bad(r"sources\[1\]\.image\.shape", image={"shape": 3})
    bad(r"sources\[1\]\.image'", image={"size": 512, "patch": 8})  # 4096 tokens > seq_len
    bad(r"sources\[1\]\.image_field", image_field="caption")
    c = image_config(str(tmp_path), "parquet")
    c["sources"][0].update(image_field="x", image={"size": 32, "patch": 16})
    with pytest.raises(ConfigError, match=r"sources\[1\]\.image\.patch"):
        load_config(c)
    # JSON has no bytes: every row of a jsonl source with an image field was bad input
    # ("field 'image' is str"), and validate said nothing (a review)
    (tmp_path / "captions.jsonl").write_text('{"text": "a cat", "jpg": "cat.jpg"}\n')
    for key, change in (("image_field", {"image_field": "jpg"}),
                        ("image", {"image": {"size": 32, "patch": 16}})):
        c = image_config(str(tmp_path), "parquet")
        c["sources"][1] = {"name": "vis", "uri": str(tmp_path / "captions.jsonl"),
                           "format": "jsonl", **change}
        with pytest.raises(ConfigError, match="a jsonl source cannot carry images") as info:
            load_config(c)
        assert info.value.key == f"sources[1].{key}"
    # the image field alone gives the defaults: 224 px, patches of 14
    c = image_config(str(tmp_path), "parquet")
    del c["sources"][1]["image"]
    c["batch"]["seq_len"] = 512
    assert load_config(c).source("vis").image.tokens == 256


def test_webdataset_groups_members_by_key(tmp_path: Any) -> None:
    _, images = write_image_corpus(str(tmp_path), "webdataset")
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


def test_a_hugging_face_image_column_is_read(tmp_path: Any) -> None:
    """Hugging Face ``datasets`` saves an Image column to parquet as a struct of the encoded
    bytes and the file's path: every row was bad input, "is dict" (a review).  Its bytes are
    the image; a row holding only a path is bad input naming it; a null row is a text
    document."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    img = image_bytes(rng, 1)
    column = pa.array([{"bytes": img, "path": "cat.jpg"}, {"bytes": None, "path": "dog.jpg"},
                       None], pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    (tmp_path / "hf").mkdir()
    path = f"{tmp_path}/hf/h.parquet"
    pq.write_table(pa.table({"caption": ["a cat", "a dog", "no image"], "image": column}), path)
    cfg = load_config({"name": "hf", "batch": {"seq_len": SEQ_LEN},
                       "sources": [{"name": "vis", "uri": path, "format": "parquet",
                                    "text_field": "caption", "image_field": "image",
                                    "image": {"size": SIZE, "patch": PATCH},
                                    "on_error": "skip"}]})
    src = cfg.source("vis")
    fmt, fs = get_format("parquet"), __import__("fsspec").filesystem("file")
    bad: list[DataError] = []
    docs = read_unit(src, fs, fmt.units(fs, path)[0], ByteTokenizer(), bad)
    assert len(docs) == 3 and len(docs[1]) == 0  # (the bad row set aside, in its place)
    assert isinstance(docs[0], ImageDoc)
    np.testing.assert_array_equal(docs[0].patches, expected_patches(img))
    np.testing.assert_array_equal(docs[2], ByteTokenizer().encode("no image"))
    (err,) = bad
    assert "row 1" in str(err) and "holds the path 'dog.jpg', not the image's bytes" in str(err)


@pytest.mark.parametrize("on_error", ["skip", "fail"])
def test_a_bad_image_of_a_webdataset_sample_names_its_key(tmp_path: Any, on_error: str) -> None:
    """A sample whose image does not decode named its row alone, which sent the user
    counting samples through the tar (a review; the sample-level errors named the key
    already).  It names the sample's key too; the other samples are read."""
    import io

    rng = np.random.default_rng(0)
    members = [("a/cat.jpg", image_bytes(rng, 1)), ("a/cat.txt", b"a cat"),
               ("a/broken.jpg", b"not an image"), ("a/broken.txt", b"a broken one"),
               ("a/note.txt", b"text only")]
    path = f"{tmp_path}/shard.tar"
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    cfg = load_config({"name": "wds", "batch": {"seq_len": SEQ_LEN},
                       "sources": [{"name": "vis", "uri": path, "format": "webdataset",
                                    "text_field": "txt", "image_field": "jpg",
                                    "image": {"size": SIZE, "patch": PATCH},
                                    "on_error": on_error}]})
    src = cfg.source("vis")
    fmt, fs = get_format("webdataset"), __import__("fsspec").filesystem("file")
    unit = fmt.units(fs, path)[0]
    where = r"source 'vis', file '.*shard\.tar', row 1: sample 'a/broken': "
    if on_error == "fail":
        with pytest.raises(DataError, match=where):
            read_unit(src, fs, unit, ByteTokenizer())
        return
    bad: list[DataError] = []
    docs = read_unit(src, fs, unit, ByteTokenizer(), bad)
    assert isinstance(docs[0], ImageDoc) and len(docs[1]) == 0
    np.testing.assert_array_equal(docs[2], ByteTokenizer().encode("text only"))
    (err,) = bad
    assert re.match(where, str(err)), str(err)


def test_a_failed_preprocess_of_a_webdataset_sample_keeps_its_cause(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Naming the sample's key, the error lost its cause, the user's exception and its
    traceback (a review of the change)."""
    import io

    (tmp_path / "failing_prep.py").write_text(
        "def fails(text, record):\n"
        "    if text == 'broken':\n"
        "        raise KeyError('no such thing')\n"
        "    return text\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = f"{tmp_path}/shard.tar"
    with tarfile.open(path, "w") as tar:
        for name, data in (("s/0.txt", b"fine"), ("s/1.txt", b"broken")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    cfg = load_config({"name": "wds", "batch": {"seq_len": SEQ_LEN},
                       "sources": [{"name": "t", "uri": path, "format": "webdataset",
                                    "text_field": "txt", "preprocess": "failing_prep:fails"}]})
    fmt, fs = get_format("webdataset"), __import__("fsspec").filesystem("file")
    with pytest.raises(DataError, match=r"row 1: sample 's/1': preprocess 'failing_prep:fails' "
                                        r"raised KeyError") as raised:
        read_unit(cfg.source("t"), fs, fmt.units(fs, path)[0], ByteTokenizer())
    assert isinstance(raised.value.__cause__, KeyError)


def test_read_unit_puts_image_tokens_first(tmp_path: Any) -> None:
    texts, images = write_image_corpus(str(tmp_path), "parquet")
    cfg = load_config(image_config(str(tmp_path), "parquet"))
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
        np.testing.assert_array_equal(d.patches, expected_patches(img))
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
