"""What a service's client refuses of its TLS settings before Dask sees them (no cluster):
each a ``ServiceError`` saying what to give, and nothing Dask itself accepts refused."""

from __future__ import annotations

from typing import Any

import dask
import pytest

from msd_dask.errors import ServiceError
from msd_dask.service.handle import _check_tls

cryptography = pytest.importorskip("cryptography")


def _temporary() -> Any:
    from distributed.security import Security

    return Security.temporary()


def test_credentials_with_a_plain_address_are_refused_saying_whose() -> None:
    """Credentials with ``tcp://`` (or a bare address) were a 47-line Dask traceback,
    "encryption required by Dask configuration" (a review of TLS)."""
    for address in ("tcp://198.18.0.1:8786", "198.18.0.1:8786"):
        with pytest.raises(ServiceError, match=r"the TLS credentials given require an encrypted "
                                               r"connection: give the scheduler's tls://"):
            _check_tls(address, _temporary())
    with dask.config.set({"distributed.comm.require-encryption": True}):
        with pytest.raises(ServiceError, match=r"Dask's config \(distributed\.comm\.require-"
                                               r"encryption\) requires an encrypted connection"):
            _check_tls("tcp://198.18.0.1:8786", None)


def test_what_dask_accepts_is_not_refused() -> None:
    """The first form of the check refused an ``inproc://`` cluster with credentials and a
    bare address under ``distributed.comm.default-scheme: tls``, which Dask accepts, and
    raised an ``AttributeError`` for a ``security`` dict, which Dask's Client takes (a
    review of the change)."""
    sec = _temporary()
    _check_tls("inproc://198.18.0.1/1/2", sec)
    _check_tls("tls://198.18.0.1:8786", sec)
    _check_tls("wss://198.18.0.1:8786", sec)
    with dask.config.set({"distributed.comm.default-scheme": "tls"}):
        _check_tls("198.18.0.1:8786", sec)
    as_dict = {"tls_ca_file": sec.tls_ca_file, "tls_client_cert": sec.tls_client_cert,
               "tls_client_key": sec.tls_client_key, "require_encryption": True}
    _check_tls("tls://198.18.0.1:8786", as_dict)
    with pytest.raises(ServiceError, match="the TLS credentials given require"):
        _check_tls("tcp://198.18.0.1:8786", as_dict)


def test_a_tls_address_needs_a_client_certificate() -> None:
    from distributed.security import Security

    with pytest.raises(ServiceError, match="uses TLS but no credentials were given"):
        _check_tls("tls://198.18.0.1:8786", None)
    with pytest.raises(ServiceError, match="uses TLS but the security given has no client "
                                           "certificate"):
        _check_tls("tls://198.18.0.1:8786", Security(tls_ca_file=_temporary().tls_ca_file))
