"""Requests to multi-storage-client, with the error policy of the ``msc://`` backend.

Every request of :mod:`.msc` and :mod:`.msc_read` goes through :func:`call`, which
resolves the URL with ``multistorageclient.resolve_storage_client`` (MSC caches one
client per profile, with its connection pool, and rebuilds the cache after a fork)
and turns failures into errors that name the URL:

- a missing object: :class:`FileNotFoundError`;
- refused credentials: :class:`~dist_checkpointing.errors.StorageAccessError` at once;
- configuration errors (unknown profile, bad URL): raised as they are;
- anything else (endpoint unreachable, connection reset): retried ``MSC_ATTEMPTS``
  times with a doubling delay, then ``StorageAccessError``.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

from ...errors import MissingDependencyError, StorageAccessError
from .. import knobs

logger = logging.getLogger(__name__)

SCHEME = "msc://"
INSTALL_HINT = "pip install dist_checkpointing[msc]"

T = TypeVar("T")


def import_msc() -> ModuleType:
    """The ``multistorageclient`` module, or :class:`MissingDependencyError` saying what to install."""
    try:
        import multistorageclient
    except ImportError as exc:
        raise MissingDependencyError(
            f"msc:// checkpoint paths need the multi-storage-client package: {INSTALL_HINT} ({exc})"
        ) from exc
    return multistorageclient


def _resolve(url: str) -> tuple[Any, str]:
    """``(StorageClient, path inside the profile)`` of ``url``."""
    client, path = import_msc().resolve_storage_client(url)
    return client, path


def call(url: str, what: str, fn: Callable[[Any, str], T]) -> T:
    """``fn(client, path)`` for ``url``, with the error policy of this module."""
    attempts = knobs.MSC_ATTEMPTS.get()
    delay = knobs.MSC_RETRY_DELAY_S.get()
    for attempt in range(1, attempts + 1):
        try:
            client, path = _resolve(url)
            return fn(client, path)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, f"{what}: no such object", url) from None
        except IsADirectoryError:
            raise
        except PermissionError as exc:
            raise StorageAccessError(
                f"{url}: {what} refused by the storage (check the credentials and permissions "
                f"of the MSC profile): {exc}"
            ) from exc
        except (MissingDependencyError, ValueError, TypeError, KeyError):
            raise  # configuration errors (unknown profile, bad URL): retrying cannot help
        except Exception as exc:  # noqa: BLE001 - connection failures, retryable errors
            if attempt == attempts:
                raise StorageAccessError(
                    f"{url}: {what} failed after {attempts} attempt(s) (is the endpoint "
                    f"reachable?): {type(exc).__name__}: {exc}"
                ) from exc
            logger.warning("%s: %s failed (%s); retrying in %.2fs", url, what, exc, delay)
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")  # pragma: no cover


def get(url: str, offset: int, size: int, whole: bool = False) -> bytes:
    """``size`` bytes of object ``url`` from ``offset`` (fewer where the object ends
    early): one GET, ranged unless ``whole`` (the caller knows it is the whole object)."""
    if whole:
        return call(url, "download", lambda c, p: bytes(c.read(p)))
    from multistorageclient.types import Range

    span = Range(offset=offset, size=size)
    return call(url, "ranged read", lambda c, p: bytes(c.read(p, byte_range=span)))


__all__ = ["INSTALL_HINT", "SCHEME", "call", "get", "import_msc"]
