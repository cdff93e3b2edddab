"""The ``msd-dask`` command line."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import textwrap
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from msd_dask.service.agent import HostAgent

__all__ = ["main"]

EPILOG = """examples:
  msd-dask demo-corpus data/demo              write the demo corpus (stdlib code + docstrings)
  msd-dask validate configs/demo.yaml         check a config, list each source's files
  msd-dask run configs/demo.yaml --steps 50   run the service and consume every rank locally
  msd-dask serve configs/demo.yaml --scheduler tcp://head:8786
                                              serve until interrupted; training jobs connect
  msd-dask set-weights demo code=0.5 prose=0.5 --scheduler tcp://head:8786
  msd-dask stop demo --scheduler tcp://head:8786
                                              free a service whose serving process was
                                              killed (it closes with that process otherwise)
  msd-dask agent --scheduler tcp://head:8786 --name demo --ranks 0-7
                                              on each training host: one Dask client for
                                              its ranks (export MSD_DASK_AGENT=<socket>)
  msd-dask serve configs/demo.yaml --scheduler tls://head:8786 \\
      --tls-ca-file ca.pem --tls-cert client.pem --tls-key client.key
                                              the same on a TLS-secured cluster

TLS settings may also come from Dask's own configuration (distributed.comm.tls.*,
e.g. DASK_DISTRIBUTED__COMM__TLS__CA_FILE), as for any Dask client.
MSD_DASK_PLANNER_THREADS=N in the workers' environment caps the threads the planner
places a step of 4,096 or more DP ranks with, and compresses a large step's work for the
constructors with (default: the cores of its worker).
"""


def _tls_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("TLS (a cluster started with dask's --tls-* options)")
    g.add_argument("--tls-ca-file", metavar="PEM", help="CA certificate file")
    g.add_argument("--tls-cert", metavar="PEM", help="this client's certificate file")
    g.add_argument("--tls-key", metavar="PEM", help="this client's private key file")


#: the attributes :func:`_tls_options` gives the parsed arguments, in their options' order
_TLS_ARGS = ("tls_ca_file", "tls_cert", "tls_key")


def _tls_given(args: argparse.Namespace) -> list[Any]:
    """The TLS options' values (``None`` where not given)."""
    return [getattr(args, k, None) for k in _TLS_ARGS]


def _security(args: argparse.Namespace) -> Any:
    """A ``distributed.security.Security`` from the TLS options, ``None`` without them."""
    given = _tls_given(args)
    if not any(given):
        return None
    if not all(given):
        raise ValueError("--tls-ca-file, --tls-cert and --tls-key go together")
    for option, path in zip(("--tls-ca-file", "--tls-cert", "--tls-key"), given, strict=True):
        if not os.path.isfile(str(path)):  # (Dask's own error named neither file nor option)
            raise ValueError(f"{option} {path}: no such file")
    import ssl

    # (a key of another certificate, or the key given as the certificate, was a bare
    # OpenSSL message naming neither option nor file: "[X509: KEY_VALUES_MISMATCH]"; a review)
    try:
        ssl.create_default_context(cafile=args.tls_ca_file)
    except (ssl.SSLError, ValueError) as e:
        raise ValueError(f"--tls-ca-file {args.tls_ca_file}: not a CA certificate ({e})") from None
    try:
        ssl.create_default_context().load_cert_chain(args.tls_cert, args.tls_key)
    except ssl.SSLError as e:
        raise ValueError(f"--tls-cert {args.tls_cert} and --tls-key {args.tls_key} are not a "
                         f"certificate and its key ({e})") from None
    from distributed.security import Security

    return Security(tls_ca_file=args.tls_ca_file, tls_client_cert=args.tls_cert,
                    tls_client_key=args.tls_key, require_encryption=True)


AGENT_EPILOG = """example, on each node of a torchrun job with 8 GPUs per node:
  export MSD_DASK_AGENT=/tmp/msd-dask-$(id -u)/agent-demo.sock
  msd-dask agent --scheduler tcp://head:8786 --name demo \\
      --ranks $((NODE_RANK*8))-$((NODE_RANK*8+7)) --socket $MSD_DASK_AGENT > $LOG 2>&1 &
  AGENT=$!                              # (LOG: a file of this host's, not a shared one)
  until grep -q "serves ranks" $LOG; do                  # connected, serving
      kill -0 $AGENT 2>/dev/null || { cat $LOG; exit 1; }   # it exited: its error
      sleep 1
  done
  torchrun --nnodes ... --node-rank $NODE_RANK --nproc-per-node 8 train.py
  kill $AGENT

With MSD_DASK_AGENT set, DataService.connect(address, name).reader(rank) reads
from the agent (no Dask client in the training process).  SIGTERM or Ctrl-C
stops the agent: it frees its shared memory and removes its socket.  Its socket
is --socket, or by default /tmp/msd-dask-UID/agent-NAME.sock (UID: the user's
id, a folder the agent makes with mode 0700; NAME: --name).
"""


def _at_least(lo: int) -> Callable[[str], int]:
    """An argparse type: an integer ``>= lo``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {value}")
        return value
    return parse


def _nonempty_address(text: str) -> str:
    """An argparse type: a scheduler's address, not empty (``--scheduler "$SCHED"`` with the
    variable unset got Dask's "missing port number in address ''", naming no option; a
    review)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty address (a shell variable not set?); give "
                                         "the scheduler's, as tcp://HOST:8786")
    address = text.strip()
    # (a scheme or port Dask cannot dial failed later as a traceback, ucx://, or as Python's
    # words naming no option, "invalid literal for int()"; a review)
    from distributed.comm.addressing import parse_address, parse_host_port

    try:
        scheme, location = parse_address(address)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{address!r}: {e}") from None
    if scheme not in _SCHEMES:
        raise argparse.ArgumentTypeError(
            f"{address!r}: a scheduler is dialled over {', '.join(_SCHEMES)}, not {scheme}://")
    try:
        port = parse_host_port(location)[1]
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{address!r}: expected HOST:PORT with a port from 1 to "
                                         "65535, as tcp://HOST:8786")
    return address


#: the schemes ``--scheduler`` takes (those a Dask client dials with no extra package)
_SCHEMES = ("tcp", "tls", "ws", "wss")


def _group_id(text: str) -> int:
    """An argparse type: a group's id, from its name or number."""
    import grp

    try:
        return grp.getgrnam(text).gr_gid
    except KeyError:
        if text.isdigit():
            return int(text)
        raise argparse.ArgumentTypeError(f"no group {text!r} on this host") from None


def _status_page(svc: Any) -> str | None:
    """The service's status page, or ``None`` where the scheduler serves no dashboard or
    does not say (a summary names no page rather than failing)."""
    try:
        return str(svc.dashboard_link)
    except Exception:  # noqa: BLE001 - no dashboard, or no answer within its wait
        return None


def _folder(text: str) -> str:
    """An argparse type: a folder's path, not empty (``"$OUT"`` with the variable unset
    wrote into the current directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (a shell variable not set?); name the "
                                         "folder to write into")
    return text


def _seconds(text: str, *, zero: bool) -> float:
    """A finite number of seconds ``> 0`` (``>= 0`` if ``zero``), at most a year (as a
    config's ``timeout``: a socket's or a message's wait takes no more), for argparse."""
    from msd_dask.errors import MAX_TIMEOUT

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds {'>=' if zero else '>'} 0, got {text}")
    if value > MAX_TIMEOUT:
        raise argparse.ArgumentTypeError(
            f"must be at most {MAX_TIMEOUT:.0f} seconds (a year), got {text}")
    return value


def _positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds ``> 0``."""
    return _seconds(text, zero=False)


def _non_negative(text: str) -> float:
    """An argparse type: a finite number of seconds ``>= 0``."""
    return _seconds(text, zero=True)


def _source_weight(text: str) -> tuple[str, float]:
    """An argparse type: ``SOURCE=WEIGHT``, a finite weight ``>= 0``."""
    name, sep, value = text.rpartition("=")  # (a weight has no '=', a source's name may)
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected SOURCE=WEIGHT, got {text!r}")
    try:
        weight = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"the weight of {name!r} is not a number: "
                                         f"{value!r}") from None
    if not math.isfinite(weight) or weight < 0:
        raise argparse.ArgumentTypeError(f"the weight of {name!r} must be a finite number "
                                         f">= 0, got {value}")
    return name, weight


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="msd-dask",
        description="An elastic multi-source data service for foundation-model training on Dask.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = sub.add_parser("run", help="start the service, drive every rank as a consumer, "
                       "print a summary")
    r.add_argument("config", help="service config (YAML)")
    r.add_argument("--scheduler", metavar="ADDR", type=_nonempty_address,
                   help="address of a running Dask scheduler (default: an embedded LocalCluster)")
    r.add_argument("--steps", type=_at_least(1), default=50, help="steps to consume (default: 50)")
    r.add_argument("--workers", type=_at_least(1), default=None,
                   help="workers of the embedded cluster (default: 2; not with --scheduler)")
    r.add_argument("--json", action="store_true", help="print the summary as JSON")
    _tls_options(r)

    s = sub.add_parser("serve", help="run the service until interrupted, for training jobs "
                       "to connect")
    s.add_argument("config", help="service config (YAML)")
    s.add_argument("--scheduler", metavar="ADDR", type=_nonempty_address, required=True,
                   help="address of the Dask scheduler")
    s.add_argument("--resume", metavar="STATE_JSON",
                   help="a state file written by `DataService.state_dict()` to continue from")
    _tls_options(s)

    v = sub.add_parser("validate", help="check a config, list each source's files and read "
                       "the fields of its first record")
    v.add_argument("config", help="service config (YAML)")

    d = sub.add_parser("demo-corpus", help="write the demo corpus (standard-library code "
                       "and docstrings)")
    d.add_argument("out_dir", type=_folder, help="directory to write into (e.g. data/demo)")

    w = sub.add_parser("set-weights", help="change the mix of a running service")
    w.add_argument("name", help="service name")
    w.add_argument("weights", nargs="+", metavar="SOURCE=WEIGHT", type=_source_weight,
                   help="a source's new weight, e.g. code=0.7 prose=0.3 (only the ratios "
                   "matter; a source not named gets 0)")
    w.add_argument("--scheduler", metavar="ADDR", type=_nonempty_address, required=True,
                   help="address of the Dask scheduler")
    w.add_argument("--from-step", type=_at_least(0), default=None, metavar="K",
                   help="first step of the new mix (default: the first unplanned step; a step "
                        "already planned takes the first unplanned one: the command prints the "
                        "step the change takes effect at)")
    _wait_option(w)
    _tls_options(w)

    a = sub.add_parser(
        "agent", help="serve this host's ranks from one connection to the service",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.fill(
            "One process per training host: connects to the service once (the host's one "
            "Dask client), reads each group of its ranks that receive the same tensors "
            "(tensor-parallel peers) once, and serves the host's training processes over a "
            "Unix socket, the tensors in shared memory.", 79),
        epilog=AGENT_EPILOG)
    a.add_argument("--scheduler", metavar="ADDR", type=_nonempty_address, required=True,
                   help="address of the Dask scheduler")
    a.add_argument("--name", required=True, help="the service's name")
    a.add_argument("--ranks", required=True, metavar="A-B",
                   help="the global ranks of this host: A-B (both included), A,B,C or a mix")
    a.add_argument("--socket", metavar="PATH",
                   help="the Unix socket to serve on (default: below)")
    a.add_argument("--group", type=_group_id, default=None, metavar="GROUP",
                   help="share the socket and the batches' shared memory with this group "
                   "(name or id; mode 0660), for ranks of another user in it, as a sidecar "
                   "container's agent serves (default: the agent's user alone; needs --socket "
                   "in a folder the group may enter)")
    a.add_argument("--prefetch", type=_at_least(1), default=None, metavar="N",
                   help="steps read ahead of a group's slowest rank (default: the "
                   "service's prefetch)")
    a.add_argument("--timeout", type=_positive_seconds, default=None, metavar="SECONDS",
                   help="seconds the agent waits for a step of the service, and its ranks' default "
                   "wait (default: the service's timeout)")
    _tls_options(a)

    so = sub.add_parser(
        "stop", help="stop a service whose starting process is gone (killed, its node "
        "lost): close its roles, free its workers and its name")
    so.add_argument("name", help="service name")
    so.add_argument("--scheduler", metavar="ADDR", type=_nonempty_address, required=True,
                    help="address of the Dask scheduler")
    so.add_argument("--timeout", type=_positive_seconds, default=30.0, metavar="SECONDS",
                    help="seconds to wait for the scheduler, and for the close of the roles "
                         "(default 30; a worker that does not answer by then is named, its "
                         "roles of the service may stay open until it goes)")
    _tls_options(so)

    st = sub.add_parser("stats", help="print the counters of a running service as JSON")
    st.add_argument("name", help="service name")
    st.add_argument("--ranks", action="store_true",
                    help="every rank's counters, and each constructor's per rank, however "
                         "many ranks (default: those of up to 64 ranks, and a summary: "
                         "quantiles and the slowest ranks)")
    st.add_argument("--scheduler", metavar="ADDR", type=_nonempty_address, required=True,
                    help="address of the Dask scheduler")
    _wait_option(st)
    _tls_options(st)
    return p


#: how long ``stats`` and ``set-weights`` try to reach the scheduler at least (more with a
#: longer ``--wait``): a mistyped or unreachable address is said in seconds, not in Dask's
#: 30 s connect timeout whatever ``--wait`` said (a review)
SCHEDULER_WAIT = 5.0

#: seconds ``msd-dask agent`` waits for the scheduler and its service at its start
AGENT_CONNECT = 30.0
#: seconds after which ``msd-dask agent`` says what it waits for, if it still does
AGENT_WAIT_SAID = 2.0


def _wait_option(p: argparse.ArgumentParser) -> None:
    """``--wait``: how long a command for a running service waits for it to appear."""
    p.add_argument("--wait", metavar="SECONDS", type=_non_negative, default=0.0,
                   help="seconds to wait for the scheduler and the service to start "
                        f"(default 0: the service must be running, else the error names the "
                        f"services that are; the scheduler is tried for {SCHEDULER_WAIT:g} s "
                        "at least)")


def _connect_within(args: argparse.Namespace) -> Any:
    """The handle of ``args.name`` for a command with :func:`_wait_option`: the scheduler
    tried for ``--wait`` seconds (at least :data:`SCHEDULER_WAIT`), then the service
    waited for ``--wait``."""
    from msd_dask.service import DataService

    return DataService.connect(args.scheduler, args.name, security=_security(args), agent=False,
                               timeout=max(args.wait, SCHEDULER_WAIT), wait=args.wait)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``msd-dask``; returns the exit status."""
    from msd_dask.errors import ServiceError

    args = _parser().parse_args(argv)
    try:
        return int(_COMMANDS[args.command](args) or 0)
    except BrokenPipeError:  # (``msd-dask validate c.yaml | head``: the reader stopped reading)
        _quiet_stdout()
        return 128 + signal.SIGPIPE  # as a command that died of SIGPIPE: what shells expect
    # (ConfigError and DataError are ValueErrors; a missing file or an unreachable
    # scheduler, OSErrors)
    except (ValueError, ServiceError, OSError) as e:
        print(f"msd-dask {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _quiet_stdout() -> None:
    """Standard output to ``/dev/null``: its reader is gone, and Python's flush at exit would
    raise the broken pipe again (as its docs on SIGPIPE advise)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


# ------------------------------------------------------------------ commands


def _validate(args: argparse.Namespace) -> int:
    from msd_dask.sources.check import check_fields, load_config
    from msd_dask.sources.discover import discover_units
    from msd_dask.sources.documents import source_fields

    cfg = load_config(_config_file(args.config))
    listed = check_fields(cfg)
    # every file's units, as the start lists them: a later file that cannot be read (or a
    # format whose units() breaks its contract) passed validate and stopped the start; a
    # review.  (Under on_error: skip such a file is set aside, as the service does.)
    quarantined: dict[str, list[str]] = {}
    skipped: dict[str, dict[str, Any]] = {}
    units, _roots = discover_units(cfg, quarantined=quarantined, skipped=skipped)
    print(f"config {args.config}: OK (service {cfg.name!r}, {cfg.parallel.world_size} ranks, "
          f"seq_len {cfg.batch.seq_len} x {cfg.batch.micro_batches} micro-batches)")
    w = cfg.weights_at(0)
    for s, first in zip(cfg.sources, listed, strict=True):
        fields = ", ".join(map(repr, source_fields(s)))
        tried = first.files.index(first.path) + 1 if first.path in first.files else 1
        which = (f"its first file {first.path}" if tried == 1 else
                 f"its first {tried} files (the last {first.path})")
        read = (f"{fields} read from the first record of {first.path}" if first.found else
                f"no record in {which}: {fields} not checked")
        print(f"\nsource {s.name!r} ({s.format}, weight {w[s.name]:.3f} at step 0, "
              f"{s.loaders} loader(s)): {len(first.files)} file(s), {len(units[s.name])} "
              f"unit(s); {read}")
        left = skipped.get(s.name)
        if left:  # (the start logs it: validate is where a user looks first; a review)
            print(f"  warning: left out {left['left']} other file(s) of folder {s.uri!r} that "
                  f"format {s.format!r} does not read: {left['named']} (name them with a "
                  "glob to read them)")
        aside = quarantined.get(s.name, [])  # (set aside when its units were listed)
        # (on_error: skip: the service sets them aside; a file found by both, once)
        aside += [str(e) for e in first.set_aside if str(e) not in aside]
        for why in aside:
            print(f"  warning: set aside (on_error: skip): {why}")
        for err in first.skipped:  # (the service quarantines each row alone)
            print(f"  warning: row skipped (on_error: skip): {err}")
        for f in first.files:
            print(f"  {f}")
    return 0


def _config_file(path: str) -> str:
    """The config argument of a command, a file that exists: the API also takes YAML text,
    and a path that does not exist (``*.yaml`` left unexpanded by the shell, say) was parsed
    as YAML and refused in the YAML parser's words."""
    if not os.path.exists(path):
        raise ValueError(f"cannot read config file {path!r}: no such file")
    return path


def _demo_corpus(args: argparse.Namespace) -> int:
    from msd_dask.examples.demo import write_demo_corpus

    counts = write_demo_corpus(args.out_dir, progress=True)
    for k, n in counts.items():
        print(f"{k}: {n} documents")
    print(f"written to {args.out_dir}")
    return 0


def _run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from msd_dask.service import DataService

    if args.scheduler and args.workers is not None:
        raise ValueError("--workers sizes the embedded cluster; with --scheduler the "
                         "scheduler's workers serve (size that cluster instead)")
    if not args.scheduler and any(_tls_given(args)):
        # (a client's certificate alone cannot start a cluster: it failed deep in Dask)
        raise ValueError("--tls-* are a client's credentials for a --scheduler started with "
                         "dask's --tls-* options; the embedded cluster (no --scheduler) "
                         "listens on 127.0.0.1 only")
    t_start = time.perf_counter()
    svc = DataService.start(_config_file(args.config), args.scheduler,
                            n_workers=args.workers or 2, security=_security(args))
    with svc:
        cfg = svc.config
        world = cfg.parallel.world_size
        readers = [svc.reader(r) for r in range(world)]
        # one member per DP group counts the group's tokens: its first rank (tp = cp = pp = 0)
        counting = {ranks[0] for ranks in cfg.parallel.dp_groups()}
        tokens = 0
        by_source: dict[str, int] = defaultdict(int)
        imbalance = []
        served: list[int] = []
        t0 = time.perf_counter()
        for _ in tqdm(range(args.steps), desc=f"{cfg.name}: steps", unit="step"):
            costs = []
            for r, reader in enumerate(readers):
                b = next(reader)
                if r == 0:
                    served.append(b.step)
                if r in counting:  # tp = cp = pp = 0: the first stage, with cu_seqlens
                    assert b.cu_seqlens is not None
                    costs.append(b.cost)
                    for m, docs in enumerate(b.documents):
                        cu = b.cu_seqlens[m].tolist()
                        for j, (src, _k, _c) in enumerate(docs):
                            by_source[src] += cu[j + 1] - cu[j]
                    tokens += b.num_tokens
            mean = sum(costs) / len(costs)
            imbalance.append(max(costs) / mean if mean else 1.0)
        elapsed = time.perf_counter() - t0
        # the target of the steps served: their weights' mean (a schedule moves them; the
        # planner's current weights are those of its last planned step, steps ahead)
        at = [cfg.weights_at(k) for k in served]
        weights = {s.name: sum(w[s.name] for w in at) / max(len(at), 1) for s in cfg.sources}
        summary = {
            "service": cfg.name,
            "steps": args.steps,
            "ranks": world,
            "seconds": elapsed,
            "startup_seconds": t0 - t_start,
            "tokens": tokens,
            "tokens_per_second": tokens / elapsed if elapsed else 0.0,
            "mix": {s: {"delivered": by_source[s] / max(tokens, 1), "weight": weights[s]}
                    for s in weights},
            "imbalance_mean": sum(imbalance) / len(imbalance),
            "imbalance_max": max(imbalance),
            # (an embedded cluster closes with the run: no dashboard left to look at)
            "dashboard": _status_page(svc) if args.scheduler else None,
        }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print_summary(summary)
    return 0


#: what ``run``'s summary says of the dashboard of the embedded cluster it closed
_NO_DASHBOARD = ("closed with the embedded cluster (with --scheduler ADDRESS the service "
                 "runs on a cluster that stays)")


def _print_summary(s: dict[str, Any]) -> None:
    print(f"\nsummary of service {s['service']!r}: {s['steps']} steps x {s['ranks']} ranks "
          f"in {s['seconds']:.1f}s (start-up {s['startup_seconds']:.1f}s)")
    print(f"  throughput : {s['tokens_per_second']:,.0f} tokens/s "
          f"({s['tokens']:,} non-padding tokens over all DP groups)")
    print("  token mix  : source        delivered   weight")
    for name, m in s["mix"].items():
        print(f"               {name:<13} {m['delivered']:9.3f} {m['weight']:8.3f}")
    print(f"  imbalance  : max/mean rank cost per step: mean {s['imbalance_mean']:.3f}, "
          f"worst {s['imbalance_max']:.3f}")
    print(f"  dashboard  : {s['dashboard'] or _NO_DASHBOARD}")


def _serve(args: argparse.Namespace) -> int:
    from msd_dask.errors import ServiceError
    from msd_dask.service import DataService

    resume = None
    if args.resume is not None:  # (an empty path, --resume "$STATE" unset, is no state)
        if not args.resume:
            raise ValueError("--resume: an empty path (a shell variable not set?); leave "
                             "--resume out to start from the first step")
        with open(args.resume, encoding="utf-8") as f:
            try:
                resume = json.load(f)
            except ValueError as e:  # (JSONDecodeError, or bytes that are not UTF-8)
                raise ValueError(f"--resume {args.resume}: not a JSON state_dict: {e}") from None
        if resume is None:  # (null: DataService.start would start from the first step)
            raise ValueError(f"--resume {args.resume}: not a JSON state_dict: it holds null")
    try:
        svc = DataService.start(_config_file(args.config), args.scheduler, resume=resume,
                                security=_security(args))
    except ServiceError as e:  # (the state refused: named with its file, as a bad JSON is)
        if args.resume and str(e).startswith("resume: "):
            raise ServiceError(f"--resume {args.resume}: {str(e)[len('resume: '):]}") from None
        raise
    stop = {"now": False}

    def _stop(signum: int, _frame: object) -> None:
        if stop["now"]:  # a second Ctrl-C or SIGTERM: stop waiting for a clean close
            raise KeyboardInterrupt
        stop["now"] = True

    # Ctrl-C too: a KeyboardInterrupt raised inside a call to the cluster could leave
    # that call half done, and close() then waits on it
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    resumed = ("" if resume is None else
               f" from step {int(resume['step']) + 1} (resumed from the state of step "
               f"{int(resume['step'])})")
    # (on a TLS cluster, the connect needs the client's credentials too)
    tls = ", security=Security(...)" if args.scheduler.startswith("tls://") else ""
    print(f"serving {svc.name!r} on {args.scheduler}{resumed}; connect with "
          f"DataService.connect({args.scheduler!r}, {svc.name!r}{tls}). Ctrl-C stops.",
          flush=True)
    page = _status_page(svc)  # (the scheduler's dashboard: the page and its metrics)
    if page is not None:
        print(f"status page: {page}", flush=True)
    lost = ("msd-dask serve: lost the scheduler at {}; restart the service from the last "
            "DataService.state_dict() (msd-dask serve --resume STATE_JSON)")
    failure: list[str] = []  # said once the service is closed: its threads log nothing then
    try:
        _watch_served(svc, args, stop, lost, failure)
    finally:  # (a close that fails, or a second Ctrl-C during it, still says why)
        if failure:
            print(failure[0], file=sys.stderr, flush=True)
    return 2 if failure else 0


def _watch_served(svc: Any, args: argparse.Namespace, stop: dict[str, bool], lost: str,
                  failure: list[str]) -> None:
    """Watch the served ``svc`` until ``stop`` says so, the scheduler is lost or the planner
    fails (its message appended to ``failure``); close it."""
    from msd_dask.errors import ServiceTimeoutError

    with svc:
        try:
            while not stop["now"]:
                time.sleep(1.0)
                err, gone = svc.link.failed, svc.client.status != "running"
                if not (gone or err):  # (failed: the planner is lost, not re-created)
                    try:  # the planner's own figures: svc.stats() also asks every loader and
                        # constructor, and one on a worker cut off but not yet dropped by the
                        # scheduler hangs or raises until its role is re-created elsewhere
                        err = svc.link.call(lambda p: p.stats(), "stats()")["error"]
                    except ServiceTimeoutError as e:
                        # the planner did not answer, or was lost and not re-created yet (no
                        # worker to put it on): this process re-creates it once it can
                        print(f"msd-dask serve: warning: {e}", file=sys.stderr, flush=True)
                        continue
                    except OSError:  # distributed's CommClosedError is one: whose comm?
                        gone = not _scheduler_answers(svc.client)
                if gone:
                    # Dask's client logs its reconnect attempts as errors: say it once, plainly
                    # (exit status 2, as every other error of msd-dask's)
                    logging.disable(logging.CRITICAL)
                    failure.append(lost.format(args.scheduler))
                    break
                if err:
                    failure.append(f"msd-dask serve: error: {err}")
                    break
        except KeyboardInterrupt:
            pass


def _scheduler_answers(client: Any) -> bool:
    """Whether ``client``'s scheduler answers within 10 s (a failed call to a role says
    nothing about the scheduler)."""
    from msd_dask.dask_internals import scheduler_workers

    try:
        scheduler_workers(client, 10)
    except Exception:  # noqa: BLE001 - unreachable, closed, or not answering
        return False
    return True


def _set_weights(args: argparse.Namespace) -> int:

    names = [n for n, _ in args.weights]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # (as a config refuses a key given twice)
        raise ValueError(f"source(s) {twice} given twice: give each source once")
    weights = dict(args.weights)
    with _connect_within(args) as svc:
        step = svc.set_weights(weights, args.from_step)
        unnamed = [s.name for s in svc.config.sources if s.name not in weights]
        mix = {s.name: weights.get(s.name, 0.0) for s in svc.config.sources}
    print(f"weights {mix} take effect at step {step}"
          + (f" ({', '.join(unnamed)} not named: weight 0, no longer drawn)" if unnamed else ""))
    return 0


def _stop(args: argparse.Namespace) -> int:
    from msd_dask.service import DataService

    open_on = DataService.stop(args.scheduler, args.name, timeout=args.timeout,
                               security=_security(args))
    print(f"stopped service {args.name!r} on {args.scheduler}")
    if open_on:  # (the name is free; what a frozen worker holds goes with it)
        print(f"msd-dask stop: warning: worker(s) {', '.join(open_on)} did not answer within "
              f"{args.timeout:g}s: the service's roles there may stay open until those "
              "workers go", file=sys.stderr)
    return 0


def _stats(args: argparse.Namespace) -> int:
    from msd_dask.core.figures import brief_stats

    with _connect_within(args) as svc:
        stats = svc.stats()
    print(json.dumps(stats if args.ranks else brief_stats(stats), indent=2, default=str))
    return 0


def _agent(args: argparse.Namespace) -> int:
    from msd_dask.service import DataService
    from msd_dask.service.agent import HostAgent, parse_ranks
    from msd_dask.service.agent_client import AGENT_ENV, check_socket_path, default_socket

    ranks = parse_ranks(args.ranks)
    if args.group is not None and not args.socket:
        # (the default folder, /tmp/msd-dask-UID, is the user's alone: mode 0700)
        raise ValueError("--group needs --socket, a path in a folder the group may enter "
                         "(the default folder is the user's alone)")
    # (a socket path too long for a Unix socket is refused before the service is connected)
    check_socket_path(args.socket or default_socket(args.name), args.name)
    # (said once the connect takes a while: a wrong --name, a service not up yet or a
    # scheduler out of reach was 30 s of silence before the error; a review.  Not at once:
    # the first line an agent prints is that it serves, which wrappers wait for)
    said = threading.Timer(AGENT_WAIT_SAID, lambda: print(
        f"msd-dask agent: waiting for service {args.name!r} on {args.scheduler} (up to "
        f"{AGENT_CONNECT:g} s for the scheduler and the service)", file=sys.stderr,
        flush=True))
    said.daemon = True
    said.start()
    try:
        svc = DataService.connect(args.scheduler, args.name, security=_security(args),
                                  agent=False, timeout=AGENT_CONNECT)
    finally:
        said.cancel()
    with svc:
        agent = HostAgent.for_service(svc, ranks, args.socket, prefetch=args.prefetch,
                                      timeout=args.timeout, group=args.group)

        def _stop(_signum: int, _frame: object) -> None:
            agent.stop()

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        threading.Thread(target=_announce, args=(agent, AGENT_ENV), daemon=True).start()
        done = threading.Event()
        failure: list[str] = []
        threading.Thread(target=_watch_agent, args=(svc, agent, args.scheduler, done, failure),
                         daemon=True).start()
        try:
            agent.run()
        finally:
            done.set()
        if failure:
            logging.disable(logging.CRITICAL)  # (Dask's client logs its reconnects as errors)
            print(f"msd-dask agent: {failure[0]}", file=sys.stderr, flush=True)
            return 2
        agent.report_returned()
    return 0


def _watch_agent(svc: Any, agent: HostAgent, address: str, done: threading.Event,
                 failure: list[str]) -> None:
    """Stop ``agent`` once its service is lost for good: its Dask client has not been
    connected to the scheduler for :data:`SCHEDULER_GRACE` seconds (a scheduler lost takes
    the service's roles with it), the planner failed for good, or a group's reader found
    the service closed by its owner or stopped, or, every :data:`PUBLISHED_EVERY` seconds,
    the service is no longer published under its name (an agent whose ranks were gone,
    so that no reader would find it closed, served on and kept its socket from the agent
    of the service's next run; a review).  It kept serving on: a
    rank waiting then was told only, at its timeout, that the agent waited for its step,
    the cause in the agent's log (a review); ``msd-dask serve`` exits so too."""
    from msd_dask.errors import CLOSED_NOTICES

    since: float | None = None  # (when the client was first seen not connected)
    looked = time.monotonic()  # (when the agent last looked at the published service)
    while not done.wait(WATCH_EVERY):
        status = svc.client.status
        since = None if status == "running" else since or time.monotonic()
        if since is not None and (status in ("closing", "closed")
                                  or time.monotonic() - since >= SCHEDULER_GRACE):
            why = (f"lost the scheduler at {address}; its ranks cannot be served: restart the "
                   "job from its last checkpoint once the service runs again")
        elif svc.link.failed:
            why = f"the service failed: {svc.link.failed}"
        elif svc.link.closed and svc.link.notice in CLOSED_NOTICES:
            # (a group's reader told so closes the link; the agent answered every rank so,
            # and kept the socket from the agent of the service's next run; a review)
            why = (f"service {svc.name!r}: {svc.link.notice}; start an agent for the "
                   "service's next run (msd-dask serve --resume)")
        elif time.monotonic() - looked >= PUBLISHED_EVERY:
            looked = time.monotonic()
            if not svc.link.published_no_more():
                continue
            why = (f"service {svc.name!r} is no longer published on {address} (closed by its "
                   "owner, or stopped); start an agent for the service's next run "
                   "(msd-dask serve --resume)")
        else:
            continue
        failure.append(why)
        agent.stop(why)
        return


#: seconds between the looks of ``msd-dask agent`` at its service (:func:`_watch_agent`)
WATCH_EVERY = 1.0
#: seconds between the looks of ``msd-dask agent`` at whether its service is still published
#: (one scheduler call per host and look: 2,048 hosts make about 140 a second)
PUBLISHED_EVERY = 15.0
#: seconds ``msd-dask agent`` waits for its client to reconnect to a scheduler it lost
#: before it exits (Dask's client tries for ``distributed.comm.timeouts.connect``, 30 s)
SCHEDULER_GRACE = 10.0


def _announce(agent: HostAgent, env: str) -> None:
    """Print one line once ``agent`` accepts connections."""
    agent.ready.wait()
    groups = "; ".join(",".join(map(str, g.ranks)) for g in agent.groups)
    print(f"agent of {agent.name!r} serves ranks {groups} on {agent.path}; "
          f"export {env}={agent.path}", flush=True)


_COMMANDS = {
    "agent": _agent,
    "run": _run,
    "serve": _serve,
    "validate": _validate,
    "demo-corpus": _demo_corpus,
    "set-weights": _set_weights,
    "stats": _stats,
    "stop": _stop,
}

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
