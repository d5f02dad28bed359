"""Streaming GETs of ``msc://`` objects: the response body lands in the caller's buffer.

MSC's ``read`` returns a whole response as one ``bytes`` object: a large GET is
received in full into fresh memory (page faults on every byte) before the reader
can copy the first tensor out of it, and the copy comes on top. Where the profile
can presign a GET (``StorageClient.generate_presigned_url``: S3 and compatible
stores), :func:`open_stream` instead sends the GET itself over a pooled
``http.client`` connection and the reader pulls the body with ``readinto`` straight
into each tensor, as it arrives. Profiles that cannot presign (a POSIX profile)
make :func:`open_stream` return ``None``: the reader then uses MSC's ``read``
(:mod:`.msc_read`). Uploads of data files built in memory go the same way
(:func:`put_whole`: one presigned PUT from that memory, else MSC's ``write``).
``MSC_PRESIGNED=0`` sends everything through MSC, as do profiles with replicas, and
PUTs of profiles with a metadata provider (MSC refuses to presign them).

A missing object is ``FileNotFoundError``. Any other failure of a streaming GET
(an endpoint that refuses presigned requests, or cannot be reached) logs one
warning and turns streaming off for the profile: its reads go through MSC's
``read`` from then on, with MSC's retries and our error policy
(:mod:`.msc_client`). TLS is verified against the default certificates, or
``AWS_CA_BUNDLE`` where set (as botocore does).
"""

from __future__ import annotations

import errno
import http.client
import logging
import os
import ssl
import threading
import urllib.parse
from typing import Any

from ...errors import StorageAccessError
from .. import knobs
from .msc_client import call

logger = logging.getLogger(__name__)

_IDLE_PER_HOST = 16

_lock = threading.Lock()
_idle: dict[tuple[str, str, int], list[http.client.HTTPConnection]] = {}
_no_presign: set[tuple[str, str]] = set()  # (profile, method) that cannot be presigned
_pid = os.getpid()


def _profile(url: str) -> str:
    return url.split("://", 1)[-1].split("/", 1)[0]


def _connection(scheme: str, host: str, port: int) -> http.client.HTTPConnection:
    global _pid
    with _lock:
        if os.getpid() != _pid:  # a forked child must not share its parent's sockets
            _idle.clear()
            _pid = os.getpid()
        pool = _idle.get((scheme, host, port))
        if pool:
            return pool.pop()
    if scheme == "https":
        context = ssl.create_default_context(cafile=os.environ.get("AWS_CA_BUNDLE") or None)
        return http.client.HTTPSConnection(host, port, context=context, timeout=60)
    return http.client.HTTPConnection(host, port, timeout=60)


def _give_back(key: tuple[str, str, int], conn: http.client.HTTPConnection) -> None:
    with _lock:
        pool = _idle.setdefault(key, [])
        if len(pool) < _IDLE_PER_HOST:
            pool.append(conn)
            return
    conn.close()


class Stream:
    """The body of one GET of bytes ``[start, end)`` of an object, read in order."""

    def __init__(
        self,
        url: str,
        key: tuple[str, str, int],
        conn: http.client.HTTPConnection,
        response: Any,
        start: int,
    ) -> None:
        self.url = url
        self._key = key
        self._conn: http.client.HTTPConnection | None = conn
        self._response = response
        self.pos = start
        self.end = start + int(response.getheader("Content-Length", "0"))

    def readinto(self, view: memoryview) -> int:
        """Fill ``view`` from :attr:`pos` (fewer bytes only where the body ends).

        Raises:
            StorageAccessError: the connection broke or timed out (names the URL).
        """
        done = 0
        try:
            while done < len(view):
                n = self._response.readinto(view[done:])
                if not n:
                    break
                done += n
        except (OSError, http.client.HTTPException) as exc:
            raise StorageAccessError(
                f"{self.url}: the streamed GET broke at byte {self.pos + done} "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        self.pos += done
        return done

    def skip(self, n: int) -> None:
        """Read past ``n`` bytes."""
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n > 0:
            got = self.readinto(scratch[: min(n, len(scratch))])
            if not got:
                return
            n -= got

    def close(self) -> None:
        """Return the connection to the pool if the body was read to its end."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self.pos >= self.end and self._response.isclosed():
            _give_back(self._key, conn)
        else:
            conn.close()


def open_stream(url: str, start: int, end: int, whole: bool) -> Stream | None:
    """A streaming GET of bytes ``[start, end)`` of object ``url`` (all of it with
    ``whole``), or None where the profile cannot presign (or ``MSC_PRESIGNED=0``).

    Raises:
        FileNotFoundError: no such object.
        StorageAccessError: refused, or unreachable after ``MSC_ATTEMPTS`` tries.
    """
    if not knobs.MSC_PRESIGNED.get() or (_profile(url), "GET") in _no_presign:
        return None
    return call(
        url, "streaming read", lambda client, path: _get(client, path, url, start, end, whole)
    )


def _send(
    key: tuple[str, str, int], target: str, headers: dict[str, str]
) -> tuple[Any, http.client.HTTPConnection]:
    """Send the GET; a pooled connection the server has closed meanwhile is replaced
    by a new one once (other failures are left to the caller's retries)."""
    for attempt in (1, 2):
        conn = _connection(*key)
        try:
            conn.request("GET", target, headers=headers)
            return conn.getresponse(), conn
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            conn.close()
            if attempt == 2:
                raise
        except BaseException:
            conn.close()
            raise
    raise AssertionError("unreachable")  # pragma: no cover


def _get(client: Any, path: str, url: str, start: int, end: int, whole: bool) -> Stream | None:
    signed = _presign(client, path, url, "GET")
    if signed is None:
        return None
    key, target = signed
    headers = {} if whole else {"Range": f"bytes={start}-{end - 1}"}
    try:
        response, conn = _send(key, target, headers)
    except (OSError, http.client.HTTPException) as exc:
        _give_up(url, "GET", f"{type(exc).__name__}: {exc}")
        return None
    if response.status in (200, 206):
        return Stream(url, key, conn, response, 0 if whole else start)
    body = response.read(4096)
    conn.close()
    if response.status == 404:
        raise FileNotFoundError(errno.ENOENT, "no such object", url)
    if response.status == 416:  # the range starts past the end: an empty body
        return None
    _give_up(url, "GET", f"HTTP {response.status} {response.reason}: {body[:200]!r}")
    return None


def _presign(
    client: Any, path: str, url: str, method: str
) -> tuple[tuple[str, str, int], str] | None:
    """``((scheme, host, port), request target)`` of a presigned ``method`` request for
    ``path``, or None where the profile cannot presign it."""
    try:
        if client.replicas:  # reads and writes that MSC spreads over replicas stay MSC's
            raise NotImplementedError("a profile with replicas")
        # MSC resolves the object behind a metadata provider's path for a GET, and
        # refuses to presign a PUT that would bypass it (ValueError).
        signed = client.generate_presigned_url(path, method=method)
    except (NotImplementedError, AttributeError, ValueError, TypeError):
        _no_presign.add((_profile(url), method))
        return None
    parts = urllib.parse.urlsplit(signed)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    return (parts.scheme, parts.hostname or "", port), target


def put_whole(url: str, data: Any) -> bool:
    """Upload ``data`` (bytes-like) as object ``url`` with one presigned PUT over a
    pooled connection, straight from memory; False where the profile cannot presign
    a PUT, the endpoint refused it, or ``MSC_PRESIGNED=0`` (the caller then
    uploads through MSC). An upload cut short leaves no object (a PUT is atomic)."""
    if not knobs.MSC_PRESIGNED.get() or (_profile(url), "PUT") in _no_presign:
        return False
    return bool(call(url, "upload", lambda client, path: _put(client, path, url, data)))


def _put(client: Any, path: str, url: str, data: Any) -> bool:
    signed = _presign(client, path, url, "PUT")
    if signed is None:
        return False
    key, target = signed
    body = memoryview(data).cast("B")
    conn = _connection(*key)
    try:
        conn.request("PUT", target, body=body, headers={"Content-Length": str(len(body))})
        response = conn.getresponse()
        reply = response.read(4096)
    except (OSError, http.client.HTTPException) as exc:
        conn.close()
        _give_up(url, "PUT", f"{type(exc).__name__}: {exc}")
        return False
    ok = response.status in (200, 201)
    if ok and response.isclosed():
        _give_back(key, conn)
    else:
        conn.close()
    if not ok:
        _give_up(url, "PUT", f"HTTP {response.status} {response.reason}: {reply[:200]!r}")
    return ok


def _give_up(url: str, method: str, why: str) -> None:
    """The endpoint refused a presigned request or could not be reached: this profile
    sends such requests through MSC from now on (which retries, and reports errors
    with their cause)."""
    profile = _profile(url)
    if (profile, method) not in _no_presign:
        logger.warning("%s: presigned %s failed (%s); going through MSC instead", url, method, why)
        _no_presign.add((profile, method))


__all__ = ["Stream", "open_stream", "put_whole"]
