"""User preprocessors and Hugging Face tokenizers through the service
(``tests/unit/test_preprocess_tokenizer.py``: the config, the tokenizer and a unit's documents)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from msd_dask import DataService
from msd_dask.examples import preprocess as prep
from msd_dask.sources.tokenizer import HFTokenizer

from checks import check_content, check_exactly_once, read_steps
from corpus import config


def test_service_with_preprocess_exactly_once_over_kept_documents(corpus):
    root, texts = corpus
    cfg = config(root, batch={"seq_len": 256, "micro_batches": 2})
    cfg["sources"][0]["preprocess"] = "msd_dask.examples.preprocess:normalize_whitespace"
    cfg["sources"][1]["preprocess"] = "msd_dask.examples.preprocess:drop_short"
    fns = {"code": prep.normalize_whitespace, "prose": prep.drop_short}
    expected = {k: fns[k[0]](t, {}) for k, t in texts.items()}
    kept = {k: t for k, t in expected.items() if t is not None}
    assert len(kept) < len(expected)
    with DataService.start(cfg, n_workers=2, threads_per_worker=1) as svc:
        recs = read_steps(svc, 100)
    check_content(recs, kept, 256)
    epochs = check_exactly_once(recs, kept, 256)
    assert epochs["code"] >= 1 and epochs["prose"] >= 1, epochs


def test_service_with_hf_tokenizer_decodes_to_source_text(corpus, bpe):
    root, texts = corpus
    seq_len = 128
    cfg = config(root, tokenizer={"kind": "hf", "path": bpe},
                 batch={"seq_len": seq_len, "micro_batches": 2})
    tok = HFTokenizer(bpe)
    with DataService.start(cfg, n_workers=2, threads_per_worker=1) as svc:
        recs = read_steps(svc, 40)
    pieces: dict[tuple[str, str, int], dict[int, np.ndarray]] = defaultdict(dict)
    for rec in recs:
        for m, docs in enumerate(rec["documents"]):
            cu = rec["cu_seqlens"][m]
            for j, (src, key, chunk) in enumerate(docs):
                seg = rec["input_ids"][m, int(cu[j]):int(cu[j + 1])]
                k = (src, key, rec["epochs"][m][j])
                assert chunk not in pieces[k], f"{k} chunk {chunk} twice in one epoch"
                pieces[k][chunk] = seg
            assert (rec["input_ids"][m, int(cu[-1]):] == tok.pad_id).all()
    complete = 0
    for (src, key, _), chunks in pieces.items():
        full = tok.encode(texts[(src, key)])
        n = -(-len(full) // seq_len)
        for c, seg in chunks.items():
            np.testing.assert_array_equal(seg, full[c * seq_len:c * seq_len + len(seg)])
        if len(chunks) == n:
            ids = np.concatenate([chunks[c] for c in range(n)])
            assert tok.decode(ids) == texts[(src, key)]
            complete += 1
    assert complete > 50, complete
