"""Load a config and check it against storage: every source's files, the tokenizer.

:func:`msd_dask.core.config.parse_config` validates a config without I/O; this
module adds what only the storage can say, and reports it against the YAML key
as the parser does.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from msd_dask.core.config import Config, parse_config
from msd_dask.errors import ConfigError

__all__ = ["check_storage", "load_config"]


def load_config(cfg: str | os.PathLike[str] | Mapping[str, Any] | Config, *,
                check_files: bool = True) -> Config:
    """Load and validate a service configuration, then check it against storage.

    Parameters
    ----------
    cfg : str, path, mapping or Config
        What :func:`~msd_dask.core.config.parse_config` takes; a :class:`Config`
        is returned as it is, unchecked.
    check_files : bool
        Check that every source's ``uri`` matches at least one file and that the
        tokenizer loads (:func:`check_storage`).

    Raises
    ------
    ConfigError
        Naming the offending key and the reason.
    """
    parsed = parse_config(cfg)
    if check_files and not isinstance(cfg, Config):
        check_storage(parsed)
    return parsed


def check_storage(cfg: Config) -> None:
    """Raise :class:`ConfigError` naming the key of the first source or tokenizer storage cannot serve.

    Each source's ``uri`` must match at least one file (``sources[i].uri``), and a
    ``kind: hf`` tokenizer must load (``tokenizer.path``).
    """
    from msd_dask.sources.storage import list_files
    from msd_dask.sources.tokenizer import make_tokenizer

    if cfg.tokenizer.kind != "bytes":
        try:
            make_tokenizer(cfg.tokenizer)
        except Exception as e:  # noqa: BLE001 - report any load failure against the key
            raise ConfigError("tokenizer.path", f"cannot load tokenizer {cfg.tokenizer.path!r}: {e}") from e
    for i, src in enumerate(cfg.sources):
        key = f"sources[{i}].uri"
        try:
            files = list_files(src.uri, src.storage_options)
        except Exception as e:  # noqa: BLE001 - report any storage error against the key
            raise ConfigError(key, f"cannot list {src.uri!r}: {e}") from e
        if not files:
            raise ConfigError(key, f"glob {src.uri!r} matches no file")
