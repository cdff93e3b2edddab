"""Load a config and check it against storage: every source's files, the tokenizer.

:func:`msd_dask.core.config.parse_config` validates a config without I/O; this
module adds what only the storage can say, and reports it against the YAML key
as the parser does; :func:`anchored` makes a local relative path absolute where the
user gave it.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from msd_dask.core.config import Config, SourceConfig, parse_config
from msd_dask.errors import ConfigError, DataError

if TYPE_CHECKING:
    from msd_dask.formats import Unit
    from msd_dask.sources.storage import SourceFiles

__all__ = ["FirstRecord", "SKIP_LOOK", "SKIP_ROWS", "anchored", "check_fields",
           "check_preprocessors", "check_storage", "format_units", "load_config"]

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
    if not isinstance(cfg, Config):
        check_preprocessors(parsed)
        if check_files:
            check_storage(parsed)
    return parsed


def check_preprocessors(cfg: Config) -> None:
    """Raise :class:`ConfigError` naming ``sources[i].preprocess`` where a source's
    preprocessor does not import here or is not a function.

    :func:`~msd_dask.core.config.parse_config` checks only the import path's form: the
    processes that read a service's published config (readers, host agents, the
    scheduler plugin) need not have the user's module; the loaders' workers do, and
    :meth:`~msd_dask.DataService.start` checks it on one of them (it lists the units
    there with :func:`load_config`).
    """
    from msd_dask.sources.documents import preprocessor

    for i, src in enumerate(cfg.sources):
        if src.preprocess is None:
            continue
        try:
            preprocessor(src.preprocess)
        except TypeError as e:
            raise ConfigError(f"sources[{i}].preprocess", str(e)) from None
        except Exception as e:  # noqa: BLE001 - any import failure is a config error
            raise ConfigError(f"sources[{i}].preprocess", f"cannot import {src.preprocess!r}: "
                              f"{type(e).__name__}: {e}") from e


def check_storage(cfg: Config) -> None:
    """Raise :class:`ConfigError` naming the key of the first source or tokenizer storage cannot serve.

    Each source's ``uri`` must match at least one file (``sources[i].uri``), and a
    ``kind: hf`` tokenizer must load (``tokenizer.path``).
    """
    from msd_dask.sources.tokenizer import make_tokenizer

    if cfg.tokenizer.kind != "bytes":
        try:
            make_tokenizer(cfg.tokenizer)
        except ConfigError:  # an id that names its own key
            raise
        except Exception as e:  # noqa: BLE001 - report any load failure against the key
            raise ConfigError("tokenizer.path", f"cannot load tokenizer {cfg.tokenizer.path!r}: {e}") from e
    for i, src in enumerate(cfg.sources):
        _source_files(i, src)


#: a local file URL's protocol: fsspec reads ``file://a``, ``file:a`` and ``local://a`` as
#: the relative path ``a``
_LOCAL_URL = re.compile(r"^(file|local):(?://)?")


def anchored(uri: str) -> str:
    """A local relative ``uri`` made absolute against this process's working directory.

    fsspec resolves a relative local path against the current directory of the process
    that lists it; the units are listed on a worker, whose directory may differ, so the
    path is fixed where the user gave it: a plain path, a local file URL (``file://a``,
    ``file:a``, ``local://a``), or either as the last target of a chained URL
    (``simplecache::a``).  Remote URLs (``s3://...``) are unchanged.
    """
    head, sep, last = uri.rpartition("::")
    local = _LOCAL_URL.match(last)
    if local is not None:
        proto, path = local.group(1) + "://", last[local.end():]
    elif "://" in last:
        return uri
    else:
        proto, path = "", last
    if os.path.isabs(path):
        return uri
    return head + sep + proto + os.path.abspath(os.path.expanduser(path))


def _source_files(i: int, src: SourceConfig) -> SourceFiles:
    """The :class:`~msd_dask.sources.storage.SourceFiles` of ``cfg.sources[i]``, ``src``; a
    :class:`ConfigError` naming ``sources[i].uri`` if it cannot be listed or matches no file."""
    from msd_dask.sources.documents import listed_files
    from msd_dask.sources.storage import IGNORED_PREFIXES, is_glob

    key = f"sources[{i}].uri"
    try:
        files = listed_files(src)
    except Exception as e:  # noqa: BLE001 - report any storage error against the key
        raise ConfigError(key, f"cannot list {src.uri!r}: {e}") from e
    if not files.paths:
        where = anchored(src.uri)  # (a local relative path: say where it was looked for)
        looked = f" (as {where!r}, from this process's directory)" if where != src.uri else ""
        what = "glob" if is_glob(src.uri) else "path"  # (a file or a folder named alone)
        raise ConfigError(key, f"{what} {src.uri!r} matches no file{looked} (names starting "
                               f"with {' or '.join(map(repr, IGNORED_PREFIXES))} are left out)")
    return files


#: files :func:`check_fields` tries, one after the other, for a source whose first files
#: have no record, or are bad and the source skips bad input (``on_error: skip``)
SKIP_LOOK = 8

#: bad rows of one file :func:`check_fields` passes over, for a source that skips bad input
#: and whose format reads on past a bad row (``errors="yield"``), before it takes the file's
#: rows for all bad (a misspelt ``text_field`` makes every row bad: not read to the end)
SKIP_ROWS = 8


class FirstRecord(NamedTuple):
    """What :func:`check_fields` found of one source."""

    #: the source's files (a folder's, those its format reads)
    files: list[str]
    #: the file whose first record was read
    path: str
    #: whether it has a record (a file without one says nothing of the fields)
    found: bool
    #: the files before it that could not be read, each one's error (``on_error: skip``
    #: only: the service sets them aside)
    set_aside: list[DataError]
    #: the bad rows passed over before that record, each one's error naming its file and
    #: row (``on_error: skip``, a format that reads on past a bad row, as JSON lines:
    #: the service quarantines such a row alone and reads the rest of its file)
    skipped: list[DataError]


def check_fields(cfg: Config) -> list[FirstRecord]:
    """Read the first record of each source's first file with the fields the source reads
    (``text_field``, ``image_field``): a misspelt field shows before the service starts,
    not when a loader first reads the file.

    Only the first record of the first file is read (a Parquet file's first row group, of
    those columns): a file further on that lacks the field is found when it is read.  A
    file without a record (an empty shard) has the next one read, up to :data:`SKIP_LOOK`
    files (:attr:`FirstRecord.found` is False where none of them has one).  A
    source that skips bad input (``on_error: skip``) whose first file cannot be read has
    the next one read, up to :data:`SKIP_LOOK` files, as the service sets such a file
    aside.  Where its format reads on past a bad row (``errors="yield"``, as JSON lines
    do), a bad row is that row's alone, as it is to the service: it is recorded
    (:attr:`FirstRecord.skipped`), and the next row is read, up to
    :data:`SKIP_ROWS` bad rows a file; a file of only bad rows has the next file read.
    A file whose storage fails for a moment is read again
    (:func:`~msd_dask.sources.documents.again_after_a_blip`).

    Parameters
    ----------
    cfg : Config

    Returns
    -------
    list of FirstRecord
        Each source's, in the config's order.

    Raises
    ------
    ConfigError
        A source's ``uri`` cannot be listed or matches no file (as :func:`check_storage`),
        is a folder without a file its format reads
        (:func:`~msd_dask.sources.storage.format_paths`), its files are all another
        built-in format's (:func:`~msd_dask.sources.storage.check_format_suffixes`), or its
        ``format`` cannot be imported.
    DataError
        Naming the source, the file and the row, and the fields the record has (under
        ``on_error: skip``, the last of the files tried, where none of them had a record
        to read: a file that cannot be read, or whose rows were all bad, its first bad
        row's).
    """
    from msd_dask.sources.documents import again_after_a_blip, source_format, with_source
    from msd_dask.sources.storage import format_paths

    firsts = []
    for i, src in enumerate(cfg.sources):
        files = _source_files(i, src)
        fmt = source_format(src, i)
        # (a folder's files its format reads, as discovery takes them)
        paths = format_paths(files, fmt, src, i)[0]
        skip = src.on_error == "skip"
        # (a file without a record says nothing of the fields: the next one is read, as
        # a file set aside under skip; else the first file of a shard set that starts
        # with an empty one left every field unchecked)
        tries = paths[:SKIP_LOOK]
        # a format that reads on past a bad row is read so here too: the service quarantines
        # such a row alone, and the file's next record is its first
        tolerant = skip and "errors" in inspect.signature(fmt.read).parameters
        set_aside: list[DataError] = []
        skipped: list[DataError] = []
        for path in tries:
            read = functools.partial(_first_record, fmt, files.fs, path, src, i, tolerant)
            try:
                found, bad = again_after_a_blip(read, src.name, path,
                                                "reading its first record")
            except ConfigError:  # (the format broke its contract: no file of it will do)
                raise
            except Exception as e:  # noqa: BLE001 - a format of the user's raises anything
                err = with_source(e, src.name, path)  # (named by source and file, as a read is)
                if skip and path != tries[-1]:
                    set_aside.append(err)
                    continue
                if skip and len(paths) > len(tries):
                    # (the service sets these files aside and reads on: the rest are not
                    # checked; the run's listing of every file says whether any is read)
                    set_aside.append(err)
                    firsts.append(FirstRecord(paths, path, False, set_aside, skipped))
                    break
                if err is e:
                    raise
                raise err from e
            skipped.extend(bad)  # (msd-dask validate warns of each)
            if not found and path != tries[-1]:  # (no record, or rows all bad: the next)
                continue
            if not found and bad:  # (rows, all bad: they say nothing of the fields)
                if len(paths) > len(tries):
                    # (the service skips those rows and reads on, as past a file set aside
                    # above: 8 files of bad rows failed validate, 8 unreadable ones did not;
                    # a review)
                    firsts.append(FirstRecord(paths, path, False, set_aside, skipped))
                    break
                raise bad[0]
            if not found and len(tries) == len(paths):
                # (every file tried, none with a record: the service stops at its first step,
                # "no documents in a whole epoch", where validate said OK; a review)
                raise DataError(f"none of its {len(paths)} file(s) holds a record: the source "
                                "has no document", source=src.name)
            firsts.append(FirstRecord(paths, path, found, set_aside, skipped))
            break
    return firsts


def _first_record(fmt: Any, fs: Any, path: str, src: SourceConfig, index: int,
                  tolerant: bool) -> tuple[bool, list[DataError]]:
    """Whether file ``path`` has a record with text (read with the fields of ``src``, the
    config's source ``index``, by format ``fmt``), and the bad rows before it.

    ``tolerant``: read with ``errors="yield"``, each bad row before the record named by
    the source and passed over, up to :data:`SKIP_ROWS` of them (then no record).  A record
    that is no mapping, or whose text field holds no text, is that row's bad input, as it
    is to the service (it was taken as the fields read, and the service stopped at its
    first step; a review).
    """
    from msd_dask.sources.documents import source_fields, text_of, with_source

    fields = source_fields(src)
    bad: list[DataError] = []
    for unit in format_units(fmt.units(fs, path), src, index, path):
        rows = (fmt.read(fs, unit, fields, errors="yield") if tolerant
                else fmt.read(fs, unit, fields))
        for row, rec in rows:
            if not isinstance(rec, DataError):
                if not isinstance(rec, Mapping):
                    raise ConfigError(f"sources[{index}].format", f"format {src.format!r} of "
                                      f"source {src.name!r} read a {type(rec).__name__} from "
                                      f"file {path!r}, row {row}, not a record (a mapping of "
                                      "its fields)")
                try:
                    text_of(src, rec, path, row)
                except DataError as e:
                    rec = e
            if not isinstance(rec, DataError):
                return True, bad
            if src.on_error != "skip":  # (the service stops at it; under skip, that row alone)
                raise with_source(rec, src.name, path)
            bad.append(with_source(rec, src.name, path))
            if len(bad) >= SKIP_ROWS:
                return False, bad
        # (a unit without rows, or of bad rows alone: the next one's)
    return False, bad


def format_units(got: Any, src: SourceConfig, index: int, path: str) -> list[Unit]:
    """What format ``src.format``'s ``units()`` returned for file ``path``, as a list of
    :class:`~msd_dask.formats.Unit`; a :class:`ConfigError` naming ``sources[index].format``
    where it broke the format's contract (None, or tuples, raised a bare ``TypeError`` or
    ``AttributeError`` in a worker's task, naming neither the source nor the format; a
    review)."""
    from msd_dask.formats import Unit

    try:
        units = list(got)
    except TypeError:
        units = None
    if units is None or not all(isinstance(u, Unit) for u in units):
        bad = repr(got if units is None else next(u for u in units if not isinstance(u, Unit)))
        shown = bad if len(bad) <= 200 else bad[:197] + "..."
        raise ConfigError(f"sources[{index}].format",
                          f"format {src.format!r} of source {src.name!r}: units() of file "
                          f"{path!r} gave {shown}, not a list of msd_dask.formats.Unit")
    return units
