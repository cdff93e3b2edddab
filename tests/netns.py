"""Hosts in Linux network namespaces, joined by a bridge, for multi-host tests.

Each host is a network namespace with its own loopback and one ``eth0`` holding its
address; the other end of that veth pair is a port of a bridge that lives in a namespace
of its own (the "switch"), so nothing touches the root namespace's networking.  Addresses
come from 198.18.0.0/15 (RFC 2544's benchmarking range).  Processes started through
:meth:`Network.start` run inside a host's namespace (``ip netns exec``); leaving
:func:`network` stops them and removes every namespace and link, also on failure.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import IO, Any

import pytest

from cluster import interrupt

TESTS = os.path.dirname(os.path.abspath(__file__))


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if out.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")


class Network:
    """Hosts ``{name: address}`` on one /24 of 198.18.0.0/15 behind a bridge."""

    def __init__(self, addresses: Mapping[str, str], prefix: str) -> None:
        assert "switch" not in addresses, "the switch's namespace is named switch"
        self.addresses = dict(addresses)
        self.prefix = prefix
        self.switch = f"{prefix}-switch"
        self.namespaces: list[str] = []
        self.procs: list[subprocess.Popen] = []

    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self.namespaces.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def build(self) -> None:
        """A host namespace per address, its veth a port of the switch's bridge (both made
        by :func:`network`)."""
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, (host, addr) in enumerate(self.addresses.items()):
            assert addr.startswith(("198.18.", "198.19.")), f"{addr} is not in 198.18.0.0/15"
            ns, port = self.ns(host), f"port{i}"
            self._add_ns(ns)
            _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                "netns", ns)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def cut(self, host: str) -> None:
        """Take ``host``'s link down at the switch: its packets go nowhere, nobody is told."""
        _ip("-n", self.switch, "link", "set", f"port{list(self.addresses).index(host)}", "down")

    def command(self, host: str, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host), *argv]

    def start(self, host: str, *argv: str, **popen: Any) -> subprocess.Popen:
        """``argv`` started in ``host``'s namespace (stopped when the network goes)."""
        proc = subprocess.Popen(self.command(host, *argv), **popen)
        self.procs.append(proc)
        return proc

    def python(self, host: str, code: str, env: Mapping[str, str], timeout: float = 60) -> str:
        """Run Python ``code`` in ``host``'s namespace (``tests/`` and ``tests/integration``
        importable); its stdout."""
        env = dict(env, PYTHONPATH=os.pathsep.join(
            [TESTS, os.path.join(TESTS, "integration"), env.get("PYTHONPATH", "")]))
        out = subprocess.run(self.command(host, sys.executable, "-c", code), env=env,
                             capture_output=True, text=True, timeout=timeout)
        if out.returncode:
            raise RuntimeError(f"python in {host} exited with {out.returncode}:\n"
                               f"{out.stdout}{out.stderr[-4000:]}")
        return out.stdout

    def close(self) -> None:
        # one at a time, the last started first: the dask scheduler after its workers
        # (see cluster.interrupt)
        for p in reversed(self.procs):
            interrupt([p])
        for ns in reversed(self.namespaces):  # their veth ends (and the bridge) go with them
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.namespaces.clear()


def unavailable() -> str | None:
    """Why network namespaces cannot be used here, or ``None``."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    return None


@contextmanager
def network(addresses: Mapping[str, str]) -> Iterator[Network]:
    """A :class:`Network` of ``addresses``; skips the test where namespaces are unavailable."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    net = Network(addresses, f"msd{os.getpid()}")
    try:
        try:  # what the hosts need: a namespace, a bridge in it, a process run in it
            net._add_ns(net.switch)
            _ip("-n", net.switch, "link", "add", "br0", "type", "bridge")
            subprocess.run(["ip", "netns", "exec", net.switch, "true"], check=True, capture_output=True,
                           timeout=30)
        except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
            pytest.skip(f"cannot create network namespaces and a bridge here: {e}")
        net.build()
        yield net
    finally:
        net.close()


def read_line(stream: IO[str], timeout: float, what: str) -> str:
    """The next line of a process's ``stream``, waiting at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not select.select([stream], [], [], max(0.0, deadline - time.monotonic()))[0]:
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no {what} within {timeout:.0f}s")
    return stream.readline()
