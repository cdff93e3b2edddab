"""Per-rank data loaders that users run today, set up the way their docs recommend.

Shared by ``bench_memory.py``, ``bench_throughput.py`` and ``bench_train.py``.
Every baseline reads the same sources as msd_dask (the demo corpus, its
sources replicated under other names, or a config's sources), tokenizes with
the same tokenizer (:class:`msd_dask.sources.tokenizer.ByteTokenizer` unless a
tokenizer config is given), mixes to the same shares of tokens (msd_dask's
weights are shares of tokens; the HF loader's ``probabilities`` pick documents, so
each source's is its weight over its mean document length:
:func:`document_probabilities`), and packs its own
documents sequentially into ``micro_batches × seq_len`` rows with
:func:`msd_dask.core.packing.pack_rows`, so a batch has exactly the fields of an
msd_dask batch (``input_ids``, ``labels``, ``position_ids``, ``cu_seqlens``).

Hugging Face ``datasets`` (:func:`hf_loader`)
    ``load_dataset(<"parquet"|"json">, data_files=..., split="train",
    streaming=True)`` per source, ``interleave_datasets(probabilities=...,
    stopping_strategy="all_exhausted")``, ``shuffle(buffer_size=1000)``,
    ``split_dataset_by_node(rank, world_size)``, then a ``torch`` ``DataLoader``
    with ``W`` workers per rank (the HF dataset shards itself across the loader
    workers); packing happens in the loader workers, as in the usual
    "pack the stream" wrappers.

MosaicML ``streaming`` is not here: ``mosaicml-streaming`` 0.13 installs, but
    it needs ``transformers<5``, ``numpy<2.2`` and ``torchvision``, which conflict
    with ``datasets`` 5.2 (``huggingface_hub>=1.31``) and the CPU build of torch
    in this environment (see docs/benchmarks.md).

``torch`` is imported only by the functions that build torch objects, so a
process that only needs :func:`demo_sources` / :func:`source_config` (the
memory benchmark's service process) does not pay for it.
"""

from __future__ import annotations

import glob
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch.utils.data

__all__ = ["SourceSpec", "demo_sources", "config_sources", "document_probabilities",
           "pack_stream", "hf_dataset", "hf_loader", "source_config"]


@dataclass(frozen=True)
class SourceSpec:
    """One source: a name, its format (``parquet`` or ``jsonl``), files and mix weight."""

    name: str
    format: str
    files: tuple[str, ...]
    weight: float
    pattern: str
    text_field: str = "text"


def demo_sources(root: str = "data/demo", replicas: int = 1,
                 weights: tuple[float, float] = (0.6, 0.4)) -> list[SourceSpec]:
    """The demo's ``code`` and ``prose`` sources, replicated ``replicas`` times.

    Replica ``i`` is a separate source (``code<i>``, ``prose<i>``) over the same
    files, with the weights divided evenly among replicas.
    """
    code = f"{root}/code/*.parquet"
    prose = f"{root}/prose/*.jsonl.zst"
    out = []
    for i in range(replicas):
        suffix = "" if replicas == 1 else str(i)
        out.append(SourceSpec(f"code{suffix}", "parquet", tuple(sorted(glob.glob(code))),
                              weights[0] / replicas, code))
        out.append(SourceSpec(f"prose{suffix}", "jsonl", tuple(sorted(glob.glob(prose))),
                              weights[1] / replicas, prose))
    for s in out:
        if not s.files:
            raise FileNotFoundError(f"no files for {s.pattern}: run `msd-dask demo-corpus {root}`")
    return out


def config_sources(cfg: Any) -> list[SourceSpec]:
    """The sources of an msd_dask :class:`~msd_dask.core.config.Config` as :class:`SourceSpec` s.

    Only local ``parquet`` and ``jsonl`` sources have a Hugging Face builder
    here; any other raises ``ValueError``.  A source's weight is its weight at
    step 0.
    """
    out = []
    for s in cfg.sources:
        if s.format not in ("parquet", "jsonl"):
            raise ValueError(f"source {s.name!r}: no HF streaming baseline for format {s.format!r}")
        files = tuple(sorted(glob.glob(s.uri)))
        if not files:
            raise FileNotFoundError(f"source {s.name!r}: no local files match {s.uri}")
        out.append(SourceSpec(s.name, s.format, files, float(s.weight.at(0)), s.uri,
                              s.text_field))
    return out


def source_config(base: dict[str, Any], sources: list[SourceSpec]) -> dict[str, Any]:
    """An msd_dask config dict from ``base`` with its sources replaced by ``sources``.

    Each new source copies the settings (loaders, text field ...) of the base
    source with the same format.
    """
    by_format = {s["format"]: s for s in base["sources"]}
    cfg = dict(base)
    cfg["sources"] = []
    for s in sources:
        d = dict(by_format[s.format])
        d.update(name=s.name, uri=s.pattern, weight=s.weight)
        cfg["sources"].append(d)
    return cfg


# ----------------------------------------------------------------------- packing
def pack_stream(texts: Iterable[str], seq_len: int, micro_batches: int,
                tokenizer: Mapping[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """Tokenize documents in order and pack them sequentially into batches.

    Rows are filled back to back; a document that does not fit is split and
    continues at the start of the next row (the usual "concatenate and chunk"
    packing, keeping document boundaries in ``cu_seqlens``).  ``tokenizer`` is
    an msd_dask tokenizer config (``{"kind": "hf", "path": ...}``); the byte
    tokenizer when ``None``.

    Yields
    ------
    dict
        ``input_ids``, ``labels``, ``position_ids`` (``torch.long``,
        ``[micro_batches, seq_len]``), ``cu_seqlens`` (list of int32 tensors) and
        ``num_tokens``.
    """
    import torch

    from msd_dask.core.config import TokenizerConfig
    from msd_dask.core.packing import pack_rows
    from msd_dask.sources.tokenizer import make_tokenizer

    tok = make_tokenizer(TokenizerConfig(**dict(tokenizer or {"kind": "bytes"})))
    rows: list[list[tuple[np.ndarray, int]]] = []
    row: list[tuple[np.ndarray, int]] = []
    used = 0
    for text in texts:
        ids = tok.encode(text)
        pos = 0
        while pos < len(ids):
            n = min(seq_len - used, len(ids) - pos)
            row.append((ids[pos:pos + n + 1], n))  # +1: the label when the document goes on
            used += n
            pos += n
            if used == seq_len:
                rows.append(row)
                row, used = [], 0
                if len(rows) == micro_batches:
                    b = pack_rows(rows, seq_len, tok.pad_id)
                    rows = []
                    # int64, as msd_dask's Batch hands them to training (pack_rows is int32)
                    yield {"input_ids": torch.from_numpy(b["input_ids"]).long(),
                           "labels": torch.from_numpy(b["labels"]).long(),
                           "position_ids": torch.from_numpy(b["position_ids"]).long(),
                           "cu_seqlens": [torch.from_numpy(c) for c in b["cu_seqlens"]],
                           "num_tokens": seq_len * micro_batches}


def _packed(ds: Any, seq_len: int, micro_batches: int,
            tokenizer: Mapping[str, Any] | None) -> torch.utils.data.IterableDataset:
    """A torch ``IterableDataset`` packing the texts of ``ds`` (re-iterated with a new epoch when it ends)."""
    import torch.utils.data

    class _Packed(torch.utils.data.IterableDataset):
        def _texts(self) -> Iterator[str]:
            epoch = 0
            while True:
                if hasattr(ds, "set_epoch"):
                    ds.set_epoch(epoch)
                n = 0
                for ex in ds:
                    n += 1
                    yield ex["text"]
                if n == 0:  # this loader worker was given no shard
                    return
                epoch += 1

        def __iter__(self) -> Iterator[dict[str, Any]]:
            return pack_stream(self._texts(), seq_len, micro_batches, tokenizer)

    return _Packed()


# ----------------------------------------------------------------------- Hugging Face
def hf_dataset(sources: list[SourceSpec], rank: int, world_size: int, seed: int = 0) -> Any:
    """The rank's ``datasets.IterableDataset`` of ``{"text"}`` examples."""
    import datasets
    from datasets import interleave_datasets, load_dataset
    from datasets.distributed import split_dataset_by_node

    datasets.logging.set_verbosity_error()
    parts = []
    for s in sources:
        builder = "parquet" if s.format == "parquet" else "json"
        ds = load_dataset(builder, data_files=list(s.files), split="train", streaming=True)
        ds = ds.select_columns([s.text_field])
        parts.append(ds if s.text_field == "text" else ds.rename_column(s.text_field, "text"))
    ds = interleave_datasets(parts, probabilities=document_probabilities(sources, parts),
                             seed=seed, stopping_strategy="all_exhausted")
    ds = ds.shuffle(seed=seed, buffer_size=1000)
    return split_dataset_by_node(ds, rank=rank, world_size=world_size)


#: documents of each source whose mean length :func:`document_probabilities` takes
SAMPLE_DOCS = 2000


def document_probabilities(sources: list[SourceSpec], parts: list[Any]) -> list[float]:
    """``interleave_datasets``' probabilities (of picking a source's next document) that give
    each source its weight's share of the tokens, as msd_dask's weights do: its weight over
    its documents' mean length, in UTF-8 bytes plus one (the byte tokenizer's tokens, the
    end-of-document id with them), over the first :data:`SAMPLE_DOCS` documents of its
    stream ``parts[i]`` (the first files; the demo's shards are dealt round robin).  With
    the weights as probabilities the demo's baseline read 99% of its tokens from ``code``
    (mean 16.6K bytes a document against ``prose``'s 209), where its weight is 0.6 (a
    review).  A BPE tokenizer's tokens per byte differ by source, so under it the shares
    are near the weights, not at them."""
    import itertools

    means = []
    for s, part in zip(sources, parts, strict=True):
        n = [len(ex["text"].encode()) + 1 for ex in itertools.islice(part, SAMPLE_DOCS)]
        if not n:
            raise ValueError(f"source {s.name!r}: no document in {s.pattern}")
        means.append(sum(n) / len(n))
    share = [s.weight / m for s, m in zip(sources, means, strict=True)]
    total = sum(share)
    return [x / total for x in share]


def hf_loader(sources: list[SourceSpec], rank: int, world_size: int, workers: int,
              seq_len: int, micro_batches: int, seed: int = 0,
              prefetch_factor: int = 2, tokenizer: Mapping[str, Any] | None = None
              ) -> torch.utils.data.DataLoader:
    """A rank's HF-streaming ``DataLoader`` (``batch_size=None``: batches are packed).

    ``tokenizer``: an msd_dask tokenizer config (the byte tokenizer when ``None``),
    built in each loader worker.
    """
    import torch.utils.data

    ds = _packed(hf_dataset(sources, rank, world_size, seed), seq_len, micro_batches, tokenizer)
    kw: dict[str, Any] = {"prefetch_factor": prefetch_factor, "persistent_workers": True} \
        if workers > 0 else {}
    return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers, **kw)


if __name__ == "__main__":  # a module of the benchmarks, not a benchmark: say which to run
    import sys

    print(__doc__)
    print("Run a benchmark that uses these loaders instead (each has --help): "
          "scripts/bench_memory.py, scripts/bench_throughput.py, scripts/bench_train.py")
    sys.exit(0 if sys.argv[1:] in ([], ["-h"], ["--help"]) else 2)
