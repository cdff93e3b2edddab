"""Train a small byte-level BPE tokenizer on the demo corpus, offline.

    msd-dask demo-corpus data/demo
    python scripts/train_demo_tokenizer.py data/demo configs/demo-bpe.tokenizer.json

then use it with ``tokenizer: {kind: hf, path: configs/demo-bpe.tokenizer.json}``.
Special tokens: ``<|endoftext|>`` (the end-of-document id) and ``<pad>``.
"""

from __future__ import annotations

import argparse
import glob
import io
import itertools
import json
import os
from collections.abc import Iterator

import pyarrow.parquet as pq
import zstandard


def texts(root: str, limit: int) -> Iterator[str]:
    """The first ``limit`` documents of each source (the prose took what the code lacked of
    its share: the mix tilted; a review)."""
    yield from itertools.islice(_code(root), limit)
    yield from itertools.islice(_prose(root), limit)


def _code(root: str) -> Iterator[str]:
    for path in sorted(glob.glob(os.path.join(root, "code", "*.parquet"))):
        yield from pq.read_table(path, columns=["text"]).column("text").to_pylist()


def _prose(root: str) -> Iterator[str]:
    for path in sorted(glob.glob(os.path.join(root, "prose", "*.jsonl.zst"))):
        with open(path, "rb") as raw:
            reader = io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(raw), "utf-8")
            for line in reader:
                yield json.loads(line)["text"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("corpus", help="directory written by `msd-dask demo-corpus`")
    ap.add_argument("out", help="where to write tokenizer.json")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--limit", type=int, default=2000, help="documents per source to train on")
    args = ap.parse_args(argv)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab, special_tokens=["<|endoftext|>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts(args.corpus, args.limit), trainer)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tok.save(args.out)
    print(f"wrote {args.out}: vocab {tok.get_vocab_size()}")


if __name__ == "__main__":
    main()
