"""An image+text source through the service end to end.

A text source mixed with an image+text source (parquet with an image bytes column, or
webdataset tar shards): every delivered image document's ``pixel_values`` are the patches
of its own stored image, decoded and resized (``tests/unit/test_multimodal.py``: the pure pieces).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import pytest

from msd_dask import DataService
from msd_dask.core.packing import IGNORE_INDEX
from msd_dask.sources.tokenizer import IMG, ByteTokenizer

from checks import check_exactly_once, shares
from corpus import IMAGE_SEQ_LEN as SEQ_LEN
from corpus import N_IMG, expected_patches, image_config, write_image_corpus


@pytest.mark.parametrize("kind", ["parquet", "webdataset"])
def test_service_delivers_pixel_values_of_listed_documents(tmp_path: Any, kind: str) -> None:
    root = str(tmp_path)
    texts, images = write_image_corpus(root, kind)
    tok = ByteTokenizer()
    cfg = image_config(root, kind)
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
                    expected_cache[(src, key)] = expected_patches(img)
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
