"""Listing every source's units: on a Dask worker, for :meth:`msd_dask.DataService.start`.

The process that starts a service never imports the file formats' libraries
(pyarrow, fsspec, s3fs, zstandard: ~30 MiB): :func:`discover_remote` has a
worker check the sources and list their units (:func:`discover_units`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from msd_dask.core.config import Config
from msd_dask.dask_internals import task_worker
from msd_dask.errors import SHOWN, ConfigError, DataError, ServiceTimeoutError, first_of
from msd_dask.sources.check import anchored, format_units, load_config

__all__ = ["anchored_config", "discover_on_worker", "discover_remote", "discover_units"]

#: the service's logger: these messages are about starting a service
_log = logging.getLogger("msd_dask.service")

#: ``{source: [(path, part, row_offset), ...]}``
Units = dict[str, list[tuple[str, int, int]]]


def _log_skipped(name: str, uri: str, fmt: str, read: int, left: int, named: str) -> None:
    """Say once that source ``name``'s folder ``uri`` had ``left`` files left out (``named``:
    the first few, :func:`~msd_dask.errors.first_of`)."""
    _log.warning("source %r: read the %d file(s) of folder %r that format %r reads; left out "
                 "%d other(s): %s (name them with a glob to read them)", name, read, uri, fmt,
                 left, named)


def discover_units(cfg: Config, threads: int = 8,
                   quarantined: dict[str, list[str]] | None = None,
                   skipped: dict[str, dict[str, Any]] | None = None
                   ) -> tuple[Units, dict[str, str]]:
    """List every source's units (parquet footers are read here, in parallel).

    A source's ``uri`` that names a folder reads only the files its format reads
    (:func:`~msd_dask.sources.storage.format_paths`); the others are left out, logged
    once per source here, or recorded in ``skipped`` when it is given (for the caller to
    log).  A file whose units cannot be listed raises :class:`DataError`, unless its
    source has ``on_error: skip``: then it is left out and its error appended to
    ``quarantined[source]``.  A file whose storage fails for a moment is listed again, as
    a read is (:func:`~msd_dask.sources.documents.again_after_a_blip`): only the third
    failure is the file's.

    Parameters
    ----------
    cfg : Config
        The service's config (its sources' ``uri`` absolute where local).
    threads : int
        Files listed at once.
    quarantined : dict, optional
        Filled with ``{source: [error, ...]}`` for the files quarantined (each logged here
        where it is not given).
    skipped : dict, optional
        Filled with ``{source: {"uri", "format", "read", "left", "named"}}`` for each source
        whose folder had files left out: its ``uri`` and ``format``, the number of files
        read and of those left out, and the first few of these (relative to the folder);
        not logged here then.

    Returns
    -------
    units : dict
        ``{source: [(path, part, row_offset), ...]}``, sorted.
    roots : dict
        ``{source: root}`` for document keys.

    Raises
    ------
    ConfigError
        A source's ``uri`` is a folder without a file its format reads
        (:func:`~msd_dask.sources.storage.format_paths`), its files are all another
        built-in format's (:func:`~msd_dask.sources.storage.check_format_suffixes`), or its
        format cannot be had.
    DataError
        A file cannot be listed (its source does not skip bad input), or a source has
        no readable unit.
    """
    # imported where units are listed (DataService.start: a worker, see
    # discover_on_worker), never by a reader or the process that starts the service
    from msd_dask.sources.documents import (
        again_after_a_blip,
        listed_files,
        source_format,
        with_source,
    )
    from msd_dask.sources.storage import format_paths

    units: Units = {}
    roots: dict[str, str] = {}
    with ThreadPoolExecutor(threads) as ex:
        for i, s in enumerate(cfg.sources):
            try:  # (the listing of the source's files too: a blip failed the whole start)
                files = listed_files(s)
            except Exception as e:  # noqa: BLE001 - any storage error, named by its source
                raise DataError(f"cannot list {s.uri!r}: {e!r}", source=s.name) from e
            fmt = source_format(s, i)
            paths, others = format_paths(files, fmt, s, i)
            if others:
                named = first_of(others, SHOWN)
                if skipped is None:
                    _log_skipped(s.name, s.uri, s.format, len(paths), len(others), named)
                else:  # (a count and a few names, not every name, to the starting process)
                    skipped[s.name] = {"uri": s.uri, "format": s.format, "read": len(paths),
                                       "left": len(others), "named": named}

            def listing(p: str, fs: Any = files.fs, fmt: Any = fmt, name: str = s.name) -> Any:
                try:
                    # (a storage blip is listed again, as a read is: set aside, the file
                    # would be out of the whole run)
                    return again_after_a_blip(lambda: fmt.units(fs, p), name, p,
                                              "listing its units")
                except Exception as e:  # noqa: BLE001 - a format of the user's raises anything
                    # (named by source and file, as a read does; under on_error: skip, the
                    # file is set aside)
                    return with_source(e, name, p)

            found, refused = [], []
            for path, got in zip(paths, ex.map(listing, paths), strict=True):
                if isinstance(got, DataError):
                    if s.on_error != "skip":
                        raise got
                    refused.append(got)
                    if quarantined is None:
                        _log.warning("set aside (on_error: skip): %s", got)
                    else:  # (the caller says it: once, not here and there; a review)
                        quarantined.setdefault(s.name, []).append(str(got))
                    continue
                found.append(format_units(got, s, i, path))
            units[s.name] = [(u.path, u.part, u.row_offset) for u in itertools.chain(*found)]
            roots[s.name] = files.root
            if not units[s.name]:
                n = len(paths)
                why = (f"all {n} were quarantined (the first: {refused[0]}): is its format "
                       f"{s.format!r} right?" if len(refused) == n else
                       f"{len(refused)} quarantined, the rest empty" if refused else
                       "empty files?")
                raise DataError(f"no readable units in {n} file(s) matching {s.uri!r} "
                                f"({why})", source=s.name)
    return units, roots


def anchored_config(cfg: Config) -> Config:
    """``cfg`` with its local relative paths (the sources' ``uri``, the tokenizer's
    ``path``) made absolute by :func:`~msd_dask.sources.check.anchored`: the workers that
    list, read and tokenize may run in another directory than the process given the
    config."""
    tok = cfg.tokenizer
    return dataclasses.replace(
        cfg, sources=tuple(dataclasses.replace(s, uri=anchored(s.uri)) for s in cfg.sources),
        tokenizer=tok if tok.path is None else dataclasses.replace(tok, path=anchored(tok.path)))


def discover_on_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """Check and list the sources of ``cfg`` (a :meth:`Config.to_dict`) on a Dask worker.

    Runs there so that the process that starts the service never imports the file
    formats' libraries.  A :class:`DataError` or :class:`ConfigError` (a ``uri``
    that matches no file) travels back as a value (both pickle with their fields), which
    :func:`discover_remote` raises in the starting process: raised in the task, the
    worker logged "Compute Failed" and its traceback, on the terminal of ``msd-dask run``
    (whose workers share it) before the command's one-line error.

    Returns
    -------
    dict
        ``{"units", "roots", "quarantined", "skipped"}`` as :func:`discover_units` gives
        them, or ``{"error": e}``.
    """
    quarantined: dict[str, list[str]] = {}
    skipped: dict[str, dict[str, Any]] = {}
    try:
        units, roots = discover_units(load_config(cfg), quarantined=quarantined,
                                      skipped=skipped)
    except (ConfigError, DataError) as e:
        # the library's own exception (its message is in e's) stays here: unpickling e.g.
        # pyarrow's would import pyarrow in the starter
        e.__cause__ = e.__context__ = e.__traceback__ = None
        return {"error": e}
    return {"units": units, "roots": roots, "quarantined": quarantined, "skipped": skipped}


def discover_remote(client: Any, cfg: Config, timeout: float
                    ) -> tuple[Units, dict[str, str], dict[str, list[str]]]:
    """:func:`discover_units` of ``cfg`` on one of ``client``'s workers, with its checks.

    Returns
    -------
    units, roots, quarantined
        As :func:`discover_units` gives them.

    Raises
    ------
    ConfigError
        A source's ``uri`` matches no file or cannot be listed, or is a folder without a
        file its format reads; or its files are all another built-in format's.
    DataError
        A file cannot be listed (its source does not skip bad input).
    ServiceTimeoutError
        The listing did not finish within ``timeout``.
    """
    fut = client.submit(discover_on_worker, anchored_config(cfg).to_dict(), pure=False)
    try:
        got = fut.result(timeout=timeout)
    except TimeoutError:
        try:
            where = client.run_on_scheduler(task_worker, fut.key, callback_timeout=5)
        except Exception:  # noqa: BLE001 - only for the message
            where = None
        fut.cancel()
        raise ServiceTimeoutError(
            f"listing the units of service {cfg.name!r}'s {len(cfg.sources)} source(s) "
            f"({', '.join(s.name for s in cfg.sources)}) on "
            f"{f'worker {where}' if where else 'a Dask worker'} did not finish within "
            f"{timeout:.0f}s (the config's 'timeout'); check that the workers reach the "
            "sources' storage") from None
    finally:
        fut.release()
    if "error" in got:
        raise got["error"]
    for entries in got["quarantined"].values():
        for entry in entries:  # (each names its source and file)
            _log.warning("set aside (on_error: skip): %s", entry)
    for name, left in got.get("skipped", {}).items():  # (logged here, where the user looks)
        _log_skipped(name, left["uri"], left["format"], left["read"], left["left"],
                     left["named"])
    return got["units"], got["roots"], got["quarantined"]
