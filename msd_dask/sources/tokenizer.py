"""Tokenizers, chosen by ``tokenizer.kind`` in the config.

* ``bytes`` (default): :class:`ByteTokenizer`, UTF-8 bytes as ids.
* ``hf``: :class:`HFTokenizer`, a Hugging Face ``tokenizer.json`` (the
  ``tokenizers`` library) read from any fsspec ``path``.

Every tokenizer has ``encode(text) -> int32 ids + [eod_id]``, ``decode(ids)``
(end-of-document, padding and image ids dropped), ``eod_id``, ``pad_id``,
``image_id`` (one image patch of an image+text document; ``None`` when the
tokenizer has none) and ``vocab_size``.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from msd_dask.core.config import TokenizerConfig
from msd_dask.errors import ConfigError

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "make_tokenizer", "EOD", "PAD",
           "EOD_TOKENS", "PAD_TOKENS", "IMG"]

EOD = 256
PAD = 257
#: the byte tokenizer's image-patch id
IMG = 258

#: Special tokens taken as end-of-document, in order of preference.
EOD_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "<|end_of_text|>", "eos")
#: Special tokens taken as padding, in order of preference.
PAD_TOKENS = ("<pad>", "<|pad|>", "[PAD]", "<|padding|>", "pad")


class Tokenizer(Protocol):
    vocab_size: int
    eod_id: int
    pad_id: int
    image_id: int | None
    #: the SHA-256 of the file it was loaded from (None: it has none), which a resume
    #: state records (a file changed in place gives documents other lengths)
    sha256: str | None

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: np.ndarray | list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids: 0-255 are bytes, 256 ends a document, 257 pads, 258 is an image patch."""

    vocab_size = 259
    eod_id = EOD
    pad_id = PAD
    image_id: int | None = IMG
    sha256: str | None = None

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` followed by the end-of-document id, as int32."""
        raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        out = np.empty(raw.size + 1, dtype=np.int32)
        out[:-1] = raw
        out[-1] = EOD
        return out

    def decode(self, ids: np.ndarray | list[int]) -> str:
        """Text of ``ids``; end-of-document and padding ids are dropped."""
        arr = np.asarray(ids)
        return bytes(arr[arr < 256].astype(np.uint8)).decode("utf-8")


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer loaded from a ``tokenizer.json``.

    The end-of-document id is ``eod_id`` when given, else the first of
    :data:`EOD_TOKENS` the vocabulary has; the padding id is ``pad_id`` when
    given, else the first of :data:`PAD_TOKENS`, else the tokenizer's own
    padding id where it is a special token of the vocabulary, else the
    end-of-document id (a default is always a special token).  ``encode`` adds no special
    tokens of the tokenizer's post-processor (BOS etc.), only the EOD id, and
    encodes a special token's text found in a document as text (its ordinary
    pieces).  ``vocab_size`` is the largest id plus one.

    Parameters
    ----------
    path : str
        fsspec path (``file``, ``s3://`` ...) of a ``tokenizer.json``.
    eod_id, pad_id : int, optional
    image_token_id : int, optional
        The id of an image patch (required for image+text sources).
    storage_options : dict, optional
        For the filesystem of ``path``.
    """

    def __init__(self, path: str, eod_id: int | None = None, pad_id: int | None = None,
                 storage_options: dict[str, Any] | None = None,
                 image_token_id: int | None = None):
        import hashlib

        import fsspec
        from tokenizers import Tokenizer as _HF

        with fsspec.open(path, "rb", **dict(storage_options or {})) as f:
            raw = f.read()
        #: the file's SHA-256 (see :class:`Tokenizer`)
        self.sha256: str | None = hashlib.sha256(raw).hexdigest()
        self._tok = _HF.from_str(raw.decode("utf-8"))
        # a special token's text inside a document ("<|endoftext|>" in a page about GPT-2)
        # is text: its pieces, not the special id (a false end of document, dropped on decode)
        self._tok.encode_special_tokens = True
        self.path = path
        # ids: the largest plus one (the vocabulary may have holes), so the loaders' token
        # width (uint16 below 65,536) holds every id
        self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self.eod_id = self._pick(eod_id, EOD_TOKENS, "eod_id", required=True)
        pad = self._pick(pad_id, PAD_TOKENS, "pad_id", required=False)
        if pad < 0 and self._tok.padding is not None:
            # (its own padding id only where it is a special token of the vocabulary: one
            # past the vocabulary went into batches, an ordinary token's was dropped from
            # every document by decode; a review)
            own = int(self._tok.padding["pad_id"])
            pad = own if 0 <= own < self.vocab_size and self._special(own) else -1
        self.pad_id = self.eod_id if pad < 0 else pad
        self.image_id = None if image_token_id is None else \
            self._pick(image_token_id, (), "image_token_id", required=True)
        if self.image_id is not None:
            self._check_image_id(self.image_id)

    def _check_image_id(self, image: int) -> None:
        """Refuse an image token id a document's own tokens can take: the end-of-document or
        padding id, or a token a text encodes to (an ordinary token of the vocabulary, or an
        added token not marked special).  Each image token of a batch stands for a row of
        ``pixel_values``; a caption's ``<image>`` text encoded to that id gave the batch more
        image tokens than patches, and the model a label of the image id to learn (a review
        of the multimodal path)."""
        for key, other in (("eod_id", self.eod_id), ("pad_id", self.pad_id)):
            if image == other:
                raise ConfigError("tokenizer.image_token_id",
                                  f"id {image} is also the tokenizer's {key} ({self.path}); an "
                                  "image token needs an id of its own")
        added = self._tok.get_added_tokens_decoder().get(image)
        if added is None or not added.special:
            what = ("an added token not marked special" if added is not None
                    else "an ordinary token of the vocabulary")
            raise ConfigError("tokenizer.image_token_id",
                              f"id {image} ({self._tok.id_to_token(image)!r}) is {what} of "
                              f"{self.path}: a document's text can encode to it, and its tokens "
                              "would be taken for image patches; use an added special token "
                              "(tokenizer.json's \"added_tokens\" with \"special\": true), "
                              "whose text in a document is encoded as text")

    def _special(self, i: int) -> bool:
        """Whether id ``i`` is an added token marked special (no document's text encodes
        to it: the only kind of token taken as a default id)."""
        added = self._tok.get_added_tokens_decoder().get(i)
        return added is not None and bool(added.special)

    def _pick(self, given: int | None, names: tuple[str, ...], key: str, required: bool) -> int:
        """The id of ``tokenizer.<key>``: ``given``, else the first of ``names`` the
        vocabulary has as a special token, else -1 (a :class:`ConfigError` naming the key
        where ``required``).

        Only a special token is taken by default: an ordinary word (``eos``, ``pad``) or an
        added token not marked special is also what a document's text encodes to, so a
        default end of document there put false ends inside documents and ``decode``
        dropped the word (a review)."""
        if given is not None:
            if not 0 <= given < self.vocab_size:
                raise ConfigError(f"tokenizer.{key}", f"id {given} is outside the vocabulary "
                                  f"[0, {self.vocab_size}) of {self.path}")
            return int(given)
        passed: list[str] = []  # names in the vocabulary, though not as a special token
        for name in names:
            i = self._tok.token_to_id(name)
            if i is None:
                continue
            if self._special(i):
                return int(i)
            passed.append(name)
        if required:
            one = len(passed) == 1
            also = (f" ({', '.join(map(repr, passed))} {'is' if one else 'are'} in it, not as "
                    f"{'a special token' if one else 'special tokens'}: a document's text can "
                    f"encode to {'it' if one else 'them'})") if passed else ""
            raise ConfigError(f"tokenizer.{key}", f"{self.path} has none of the special tokens "
                              f"{list(names)}{also}; set tokenizer.{key}")
        return -1

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` followed by the end-of-document id, as int32."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        out = np.empty(len(ids) + 1, dtype=np.int32)
        out[:-1] = ids
        # (the image id is refused where a text can encode to it, _check_image_id; a text
        # that still does, a special token's text that is a word of the vocabulary too,
        # would give its batch more image tokens than patches: that document is bad input)
        if self.image_id is not None and (out[:-1] == self.image_id).any():
            raise ValueError(f"the text encodes to the image token id {self.image_id} "
                             "(tokenizer.image_token_id): each image token stands for an "
                             "image patch")
        out[-1] = self.eod_id
        return out

    def decode(self, ids: np.ndarray | list[int]) -> str:
        """Text of ``ids``; end-of-document and padding ids are dropped."""
        arr = np.asarray(ids)
        image = -1 if self.image_id is None else self.image_id  # (an image id may be 0)
        arr = arr[(arr != self.eod_id) & (arr != self.pad_id) & (arr != image)]
        return str(self._tok.decode([int(i) for i in arr], skip_special_tokens=False))


def make_tokenizer(cfg: TokenizerConfig) -> ByteTokenizer | HFTokenizer:
    """Build the tokenizer a config names."""
    if cfg.kind == "bytes":
        return ByteTokenizer()
    if cfg.kind == "hf":
        if not cfg.path:
            raise ValueError("tokenizer kind 'hf' needs a 'path' to a tokenizer.json")
        return HFTokenizer(cfg.path, cfg.eod_id, cfg.pad_id, dict(cfg.storage_options),
                           cfg.image_token_id)
    raise ValueError(f"unknown tokenizer kind {cfg.kind!r}")
