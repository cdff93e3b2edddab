"""User preprocessors (``sources[i].preprocess``) and Hugging Face tokenizers (``tokenizer.kind: hf``);
through the service: ``tests/integration/test_preprocess_tokenizer_service.py``."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from msd_dask import ConfigError, DataError, load_config
from msd_dask.core.config import TokenizerConfig
from msd_dask.examples import preprocess as prep
from msd_dask.sources.documents import read_unit
from msd_dask.sources.tokenizer import ByteTokenizer, HFTokenizer, make_tokenizer

from corpus import config, source_units, train_bpe

# ------------------------------------------------------------------ config


def _src_cfg(root: str, **src) -> dict:
    cfg = config(root)
    cfg["sources"][1].update(src)
    return cfg


def test_preprocess_config_validation(corpus):
    root, _ = corpus
    for bad in ("nocolon", "a b:c", ":f", "m:", 3):
        with pytest.raises(ConfigError, match=r"sources\[1\]\.preprocess.*import path"):
            load_config(_src_cfg(root, preprocess=bad))
    with pytest.raises(ConfigError, match=r"sources\[1\]\.preprocess.*cannot import.*ModuleNotFound"):
        load_config(_src_cfg(root, preprocess="msd_dask.no_such_module:f"))
    with pytest.raises(ConfigError, match=r"sources\[1\]\.preprocess.*cannot import.*AttributeError"):
        load_config(_src_cfg(root, preprocess="msd_dask.examples.preprocess:nope"))
    with pytest.raises(ConfigError, match=r"sources\[1\]\.preprocess.*not a function"):
        load_config(_src_cfg(root, preprocess="msd_dask.examples.preprocess:MIN_CHARS"))
    cfg = load_config(_src_cfg(root, preprocess="msd_dask.examples.preprocess:clean"))
    assert cfg.sources[1].preprocess == "msd_dask.examples.preprocess:clean"
    assert load_config(cfg.to_dict()) == cfg


def test_a_published_config_parses_without_the_preprocessors_module(corpus):
    """A reader's ``DataService.connect``, a host agent and the scheduler plugin parse the
    published config (``parse_config``): they imported the user's preprocess module and
    failed where only the workers have it (review).  The parse checks the import path's
    form; ``load_config`` imports, and so does the unit listing on a worker at start."""
    from msd_dask.core.config import parse_config
    from msd_dask.sources.discover import discover_on_worker

    root, _ = corpus
    d = _src_cfg(root, preprocess="only_on_the_workers:clean")
    assert parse_config(d).sources[1].preprocess == "only_on_the_workers:clean"
    with pytest.raises(ConfigError, match=r"sources\[1\]\.preprocess.*cannot import.*"
                                          "ModuleNotFound") as info:
        load_config(d)
    assert info.value.key == "sources[1].preprocess"
    # DataService.start, on a worker without it: the error comes back as the listing task's
    # value (discover_remote raises it in the starting process)
    err = discover_on_worker(parse_config(d).to_dict())["error"]
    assert isinstance(err, ConfigError) and err.key == "sources[1].preprocess"


def test_tokenizer_config_validation(corpus, bpe):
    root, _ = corpus
    with pytest.raises(ConfigError, match=r"tokenizer\.path.*is required|tokenizer\.path.*non-empty"):
        load_config(config(root, tokenizer={"kind": "hf"}))
    with pytest.raises(ConfigError, match=r"tokenizer\.path.*cannot load"):
        load_config(config(root, tokenizer={"kind": "hf", "path": root + "/missing.json"}))
    with pytest.raises(ConfigError, match=r"tokenizer\.eod_id.*only applies to kind 'hf'"):
        load_config(config(root, tokenizer={"kind": "bytes", "eod_id": 3}))
    with pytest.raises(ConfigError, match=r"tokenizer\.pad_id.*integer"):
        load_config(config(root, tokenizer={"kind": "hf", "path": bpe, "pad_id": "x"}))
    # an id outside the vocabulary names its own key (it was reported against tokenizer.path,
    # and pad_id as "id": review)
    for key in ("eod_id", "pad_id", "image_token_id"):
        with pytest.raises(ConfigError, match=rf"'tokenizer\.{key}': id 1000000 is outside "
                                              "the vocabulary") as info:
            load_config(config(root, tokenizer={"kind": "hf", "path": bpe, key: 10**6}))
        assert info.value.key == f"tokenizer.{key}"
    cfg = load_config(config(root, tokenizer={"kind": "hf", "path": bpe}))
    assert cfg.tokenizer == TokenizerConfig(kind="hf", path=bpe)
    assert load_config(cfg.to_dict()) == cfg
    assert load_config(config(root)).to_dict()["tokenizer"] == {"kind": "bytes"}


# ---------------------------------------------------------------- tokenizers


def test_hf_tokenizer_special_ids_and_round_trip(corpus, bpe, tmp_path):
    _, texts = corpus
    tok = make_tokenizer(TokenizerConfig(kind="hf", path=bpe))
    assert isinstance(tok, HFTokenizer)
    assert tok.eod_id == tok._tok.token_to_id("<|endoftext|>")
    assert tok.pad_id == tok._tok.token_to_id("<pad>")
    for text in list(texts.values())[:40] + ["", "  leading\tand trailing \n", "ünï 🙂 code"]:
        ids = tok.encode(text)
        assert ids.dtype == np.int32 and ids[-1] == tok.eod_id
        assert tok.decode(ids) == text
    assert len(tok.encode(texts[("code", "part-0.parquet:0")])) < len(
        ByteTokenizer().encode(texts[("code", "part-0.parquet:0")]))
    # no pad token: padding falls back to the end-of-document id; explicit ids win
    other = train_bpe(["abc abd"], str(tmp_path / "t.json"), vocab=300, pad=False)
    t2 = HFTokenizer(other)
    assert t2.eod_id == t2._tok.token_to_id("</s>") and t2.pad_id == t2.eod_id
    t3 = HFTokenizer(other, eod_id=5, pad_id=6)
    assert (t3.eod_id, t3.pad_id) == (5, 6)
    # no EOD token and no eod_id: refused, naming the key to set
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE()).save(str(tmp_path / "bare.json"))
    with pytest.raises(ValueError, match="set tokenizer.eod_id"):
        HFTokenizer(str(tmp_path / "bare.json"))


def test_hf_default_ids_are_special_tokens_only(tmp_path):
    """An ordinary word ``eos`` or an added ``</s>`` not marked special was taken as the
    default end of document (and ``pad`` as padding): a document's own text encodes to it,
    so documents carried false ends and ``decode`` dropped the word (a review).  Only a
    special token is a default; without one, the error names the key and the word."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    def save(name, vocab, added=(), special=()):
        raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        raw.pre_tokenizer = pre_tokenizers.Whitespace()
        raw.add_tokens([AddedToken(t, special=False) for t in added])
        raw.add_special_tokens(list(special))
        raw.save(str(tmp_path / name))
        return str(tmp_path / name)

    words = {"[UNK]": 0, "hello": 1, "eos": 2, "pad": 3}
    with pytest.raises(ConfigError, match=r"tokenizer\.eod_id.*'eos' is in it, not as a "
                                          r"special token.*set tokenizer\.eod_id"):
        HFTokenizer(save("plain.json", words))
    with pytest.raises(ConfigError, match=r"'</s>', 'eos' are in it, not as special tokens"):
        HFTokenizer(save("added.json", words, added=["</s>"]))
    # a special end of document; "pad" is a word of the text, so padding is the end's id
    tok = HFTokenizer(save("gpt2.json", words, special=["<|endoftext|>"]))
    eod = tok._tok.token_to_id("<|endoftext|>")
    assert (tok.eod_id, tok.pad_id) == (eod, eod)
    ids = tok.encode("hello eos pad hello")
    assert ids.tolist() == [1, 2, 3, 1, eod] and tok.decode(ids) == "hello eos pad hello"
    # a special "pad" is padding
    assert HFTokenizer(save("both.json", {"[UNK]": 0, "hello": 1},
                            special=["</s>", "pad"])).pad_id == 3
    # the tokenizer's own padding id only where it is a special token: one past the
    # vocabulary went into batches, an ordinary word's was dropped from documents by decode
    # (a review)
    for own, want in ((5000, eod), (1, eod), (eod, eod)):
        raw = Tokenizer.from_file(save("padded.json", words, special=["<|endoftext|>"]))
        raw.enable_padding(pad_id=own, pad_token="[PAD]")
        raw.save(str(tmp_path / "padded.json"))
        tok = HFTokenizer(str(tmp_path / "padded.json"))
        assert tok.pad_id == want and tok.decode(tok.encode("hello eos")) == "hello eos"
    raw = Tokenizer.from_file(save("padded.json", words, special=["<|endoftext|>", "[PAD]"]))
    raw.enable_padding(pad_id=raw.token_to_id("[PAD]"), pad_token="[PAD]")
    raw.save(str(tmp_path / "padded.json"))
    assert HFTokenizer(str(tmp_path / "padded.json")).pad_id == raw.token_to_id("[PAD]")


def test_hf_decode_drops_an_image_token_of_id_0(bpe):
    """``image_token_id: 0`` is a valid id; ``decode`` kept it (``0 or -1`` is -1).  (Id 0
    is the fixture's end-of-document token, a special one: the test moves end of document
    and padding to a token of their own.)"""
    tok = HFTokenizer(bpe, eod_id=5, pad_id=5, image_token_id=0)
    assert tok.image_id == 0 and 0 not in (tok.eod_id, tok.pad_id)
    ids = np.concatenate([np.full(4, 0, dtype=np.int32), tok.encode("hello")])
    assert tok.decode(ids) == "hello"


def _with_added(path: str, out: str, special: list[str], plain: list[str]) -> str:
    """The tokenizer at ``path`` with ``special`` added as special tokens and ``plain`` as
    added tokens not marked special, saved at ``out``."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(path)
    tok.add_special_tokens(special)
    tok.add_tokens(plain)
    tok.save(out)
    return out


def test_an_image_token_id_a_text_can_encode_to_is_refused(bpe, tmp_path):
    """Each image token of a batch stands for a row of ``pixel_values``.  An image id that
    is an added token not marked special (``<image>``, as LLaVA-style captions write it),
    an ordinary token, or the end-of-document or padding id, let a caption's own tokens
    take it: the batch had more image tokens than patches, and the labels the image id
    (a review of the multimodal path).  Each is one error naming the key; an added special
    token is taken, and its text in a caption stays text."""
    path = _with_added(bpe, str(tmp_path / "t.json"), ["<img>"], ["<image>"])
    base = HFTokenizer(path)
    img, image, plain = (base._tok.token_to_id(t) for t in ("<img>", "<image>", "a"))
    assert plain is not None
    for given, said in ((image, "an added token not marked special"),
                        (plain, "an ordinary token of the vocabulary"),
                        (base.eod_id, "also the tokenizer's eod_id"),
                        (base.pad_id, "also the tokenizer's pad_id")):
        with pytest.raises(ConfigError, match=said) as info:
            HFTokenizer(path, image_token_id=given)
        assert info.value.key == "tokenizer.image_token_id"
    tok = HFTokenizer(path, image_token_id=img)
    ids = tok.encode("a caption with <img> and <image> in it")
    assert not (ids == img).any() and tok.decode(ids) == "a caption with <img> and <image> in it"


def test_hf_special_token_text_in_a_document_is_text(bpe):
    """A document that mentions ``<|endoftext|>`` or ``<pad>`` (a page about GPT-2) gets no
    end-of-document or padding id inside it, and decodes to its own text."""
    tok = HFTokenizer(bpe)
    doc = "GPT-2 separates documents with <|endoftext|> and pads with <pad> tokens."
    ids = tok.encode(doc)
    inner = ids[:-1]
    assert not (inner == tok.eod_id).any() and not (inner == tok.pad_id).any()
    assert ids[-1] == tok.eod_id
    assert tok.decode(ids) == doc


def test_hf_vocab_size_covers_the_largest_id(tmp_path):
    """``vocab_size`` is the largest id + 1 where the ids have holes: the loaders' uint16
    width is taken only when every id fits it (an id of 70,000 was wrapped to 4,464)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "<pad>": 1, "[UNK]": 2, "hello": 3, "world": 69999,
             "<img>": 70000}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    # (their ids in the vocabulary: the image token's and the end of document's)
    raw.add_special_tokens(["<img>", "<|endoftext|>", "<pad>"])
    raw.save(str(tmp_path / "holes.json"))
    tok = HFTokenizer(str(tmp_path / "holes.json"), image_token_id=70000)
    assert tok.vocab_size == 70001 and tok.image_id == 70000
    (tmp_path / "d.jsonl").write_text('{"text": "hello world"}\n')
    cfg = load_config({"name": "holes", "parallel": {"dp": 1}, "batch": {"seq_len": 16},
                       "tokenizer": {"kind": "hf", "path": str(tmp_path / "holes.json")},
                       "sources": [{"name": "s", "uri": str(tmp_path / "d.jsonl"),
                                    "format": "jsonl"}]})
    fs, units = source_units(cfg.sources[0])
    docs = read_unit(cfg.sources[0], fs, units[0], tok)
    assert docs[0].tolist() == [3, 69999, 0]


# --------------------------------------------------------------- preprocess


def test_read_unit_preprocess_drops_replaces_and_reports(corpus):
    root, texts = corpus
    cfg = load_config(_src_cfg(root, preprocess="msd_dask.examples.preprocess:clean"))
    src = cfg.sources[1]
    fs, units = source_units(src)
    tok = ByteTokenizer()
    dropped = kept = 0
    for u in units:
        docs = read_unit(src, fs, u, tok)
        for i, d in enumerate(docs):
            key = ("prose", f"{u.path.rsplit('/', 1)[-1]}:{u.row_offset + i}")
            want = prep.clean(texts[key], {})
            if want is None:
                assert len(d) == 0  # a placeholder: length 0, skipped by the stream
                dropped += 1
            else:
                np.testing.assert_array_equal(d, tok.encode(want))
                kept += 1
    assert dropped > 0 and kept > 0
    bad = dataclasses.replace(src, preprocess="msd_dask.examples.preprocess:fail_on_marker")
    fail_root = root + "/fail"
    import json
    import os

    os.makedirs(fail_root, exist_ok=True)
    with open(f"{fail_root}/x.jsonl", "w") as f:
        f.write(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": "a FAIL-ME b"}) + "\n")
    bad = dataclasses.replace(bad, uri=f"{fail_root}/*.jsonl")
    fs, units = source_units(bad)
    with pytest.raises(DataError, match=r"source 'prose', file '.*x\.jsonl', row 1: preprocess "
                       r"'msd_dask.examples.preprocess:fail_on_marker' raised ValueError"):
        read_unit(bad, fs, units[0], tok)




def test_train_demo_tokenizer_script(corpus, tmp_path):
    import runpy

    root, texts = corpus
    mod = runpy.run_path(str(__import__("pathlib").Path(__file__).parents[2]
                             / "scripts" / "train_demo_tokenizer.py"))
    out = str(tmp_path / "bpe.json")
    mod["main"]([root, out, "--vocab", "320"])
    tok = make_tokenizer(TokenizerConfig(kind="hf", path=out))
    assert tok.vocab_size == 320 and tok.eod_id == 0 and tok.pad_id == 1
    text = texts[("prose", "part-0.jsonl.zst:3")]
    assert tok.decode(tok.encode(text)) == text


def test_train_demo_tokenizer_takes_at_most_limit_documents_of_each_source(tmp_path):
    # the prose took what the code lacked of a combined 2 x limit: 5 code, 35 prose
    # documents at --limit 20 (a review)
    import runpy

    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    (tmp_path / "code").mkdir()
    (tmp_path / "prose").mkdir()
    pq.write_table(pa.table({"text": [f"code {i}" for i in range(5)]}),
                   tmp_path / "code" / "part-00000.parquet")
    lines = b"".join(b'{"text": "prose %d"}\n' % i for i in range(40))
    (tmp_path / "prose" / "part-00000.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress(lines))
    mod = runpy.run_path(str(__import__("pathlib").Path(__file__).parents[2]
                             / "scripts" / "train_demo_tokenizer.py"))
    got = list(mod["texts"](str(tmp_path), 20))
    assert got == [f"code {i}" for i in range(5)] + [f"prose {i}" for i in range(20)]


@pytest.mark.parametrize("pool", ["none", "process"])
def test_a_text_of_no_tokens_is_dropped_not_a_one_token_document(corpus, tmp_path, pool):
    """An empty text became a document of its end-of-document token alone: a piece of the
    plan's and a separator in a row, for nothing.  It is dropped now, as a document a
    preprocess drops (length 0, its row kept), by the thread and the process pool alike."""
    import json

    from msd_dask.sources.documents import DocPool

    root, _ = corpus
    with open(tmp_path / "x.jsonl", "w") as f:
        for text in ("", "ab", "", " "):
            f.write(json.dumps({"text": text}) + "\n")
    src = load_config(_src_cfg(root, uri=f"{tmp_path}/*.jsonl")).sources[1]
    fs, units = source_units(src)
    tok = ByteTokenizer()
    docs_pool = DocPool(src, {"kind": "bytes"}, 1, "process") if pool == "process" else None
    try:
        docs = read_unit(src, fs, units[0], tok, pool=docs_pool)
    finally:
        if docs_pool is not None:
            docs_pool.close()
    assert [len(d) for d in docs] == [0, 3, 0, 2]
    np.testing.assert_array_equal(docs[1], tok.encode("ab"))


def test_a_text_that_encodes_to_the_image_id_is_bad_input_naming_its_row(tmp_path):
    """The backstop behind the tokenizer's check: a tokenizer whose text still gives the
    image id (here a special token's text that is a word of the vocabulary too, under a
    pre-tokenizer that keeps it whole) makes that document bad input, named by its row,
    not a batch with more image tokens than patches."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "[UNK]": 1, "dog": 2, "cat": 3, "<img>": 97}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.add_special_tokens(["<img>", "<|endoftext|>"])
    raw.save(str(tmp_path / "clash.json"))
    tok = HFTokenizer(str(tmp_path / "clash.json"), image_token_id=97)  # (special: taken)

    (tmp_path / "d.jsonl").write_text('{"text": "dog"}\n{"text": "cat <img>"}\n')
    cfg = load_config({"name": "clash", "parallel": {"dp": 1}, "batch": {"seq_len": 16},
                       "sources": [{"name": "s", "uri": str(tmp_path / "d.jsonl"),
                                    "format": "jsonl"}]})
    fs, units = source_units(cfg.sources[0])
    with pytest.raises(DataError, match=r"encodes to the image token id 97.*row 1|row 1.*"
                                        r"encodes to the image token id 97"):
        read_unit(cfg.sources[0], fs, units[0], tok)
