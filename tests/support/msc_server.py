"""A real S3-protocol server on 127.0.0.1 for the ``msc://`` tests: moto's threaded server.

The session-scoped fixture :func:`msc_store` starts ``moto.server.ThreadedMotoServer`` on a
free loopback port, enables its request authentication (an IAM user with an allow-all policy
is created first, so that wrong credentials are refused with 403), creates a bucket, writes
an MSC configuration file and points ``MSC_CONFIG`` at it for the whole session (the
multi-rank harness hands the parent's environment to each rank). Its profiles:

- ``s3``: the bucket, with the IAM user's keys;
- ``local``: a posix (local file system) profile under a temporary directory;
- ``s3-badcreds``: the bucket with keys the server does not know (refused);
- ``s3-down``: an endpoint where nothing listens (connection refused).
- ``s3open``: a second moto server, in its own process and without request
  authentication, which (unlike the first) serves presigned GETs: the profile on
  which reads are streamed (:mod:`dist_checkpointing.engine.storage.msc_stream`).

Tests take unique prefixes (:meth:`MscStore.url`), so they share the server safely.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

BUCKET = "dist-ckpt-test"
REGION = "us-east-1"
PROFILES = ("s3", "local")  # the profiles every msc suite runs against

_counter = itertools.count()


@dataclass
class MscStore:
    """The running server and the MSC configuration pointing at it."""

    endpoint: str
    config_path: str
    access_key: str
    secret_key: str
    local_root: str

    def url(self, profile: str, name: str = "ckpt") -> str:
        """A fresh ``msc://profile/...`` prefix (unique within the session)."""
        return f"msc://{profile}/t{next(_counter)}-{os.getpid()}/{name}"

    def boto3_client(self) -> Any:
        """A boto3 S3 client for the bucket's endpoint (test setup and checks)."""
        import boto3

        return boto3.client("s3", **self.boto3_kwargs())

    def boto3_kwargs(self) -> dict[str, str]:
        return {
            "endpoint_url": self.endpoint,
            "region_name": REGION,
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
        }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _s3_profile(endpoint: str, access_key: str, secret_key: str) -> dict[str, Any]:
    return {
        "storage_provider": {
            "type": "s3",
            "options": {
                "base_path": BUCKET,
                "endpoint_url": endpoint,
                "region_name": REGION,
                "connect_timeout": 2,
                "retries": {"max_attempts": 1},
            },
        },
        "credentials_provider": {
            "type": "S3Credentials",
            "options": {"access_key": access_key, "secret_key": secret_key},
        },
    }


def msc_config(
    endpoint: str, access_key: str, secret_key: str, local_root: str, open_endpoint: str = ""
) -> dict[str, Any]:
    """The MSC configuration of the test profiles (see the module docstring)."""
    return {
        "profiles": {
            "s3open": _s3_profile(open_endpoint or endpoint, "open", "open"),
            "s3": _s3_profile(endpoint, access_key, secret_key),
            "local": {"storage_provider": {"type": "file", "options": {"base_path": local_root}}},
            "s3-badcreds": _s3_profile(endpoint, "AKIAUNKNOWNKEY000000", "wrong-secret"),
            "s3-down": _s3_profile(f"http://127.0.0.1:{free_port()}", "a", "b"),
        }
    }


def _start_open_server() -> tuple[subprocess.Popen[bytes], str]:
    """moto's S3 server in a process of its own (its authentication setting is global to
    the process that runs it); stopped by the fixture."""
    port = free_port()
    cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("the second moto server did not start") from None
            time.sleep(0.1)


def _create_iam_user(endpoint: str) -> tuple[str, str]:
    """Turn on request authentication after the 3 requests that create an allow-all user."""
    import boto3
    import moto.settings

    moto.settings.INITIAL_NO_AUTH_ACTION_COUNT = 3
    iam = boto3.client(
        "iam",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id="bootstrap",
        aws_secret_access_key="bootstrap",
    )
    iam.create_user(UserName="ckpt")
    policy = {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
    }
    iam.put_user_policy(UserName="ckpt", PolicyName="all", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName="ckpt")["AccessKey"]
    return str(key["AccessKeyId"]), str(key["SecretAccessKey"])


@pytest.fixture(scope="session")
def msc_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MscStore]:
    """The moto S3 server and MSC profiles (see the module docstring); skips without
    multistorageclient / moto."""
    pytest.importorskip("multistorageclient")
    pytest.importorskip("boto3")
    server_module = pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request
    port = free_port()
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    saved_env = os.environ.get("MSC_CONFIG")
    open_server, open_endpoint = _start_open_server()
    try:
        access_key, secret_key = _create_iam_user(endpoint)
        root = tmp_path_factory.mktemp("msc")
        local_root = root / "local-profile"
        local_root.mkdir()
        store = MscStore(endpoint, str(root / "msc_config.json"), access_key, secret_key, "")
        store.local_root = str(local_root)
        store.boto3_client().create_bucket(Bucket=BUCKET)
        import boto3

        boto3.client(
            "s3",
            endpoint_url=open_endpoint,
            region_name=REGION,
            aws_access_key_id="open",
            aws_secret_access_key="open",
        ).create_bucket(Bucket=BUCKET)
        config = msc_config(endpoint, access_key, secret_key, str(local_root), open_endpoint)
        Path(store.config_path).write_text(json.dumps(config, indent=2))
        os.environ["MSC_CONFIG"] = store.config_path
        yield store
    finally:
        if saved_env is None:
            os.environ.pop("MSC_CONFIG", None)
        else:
            os.environ["MSC_CONFIG"] = saved_env
        server.stop()
        open_server.terminate()
        open_server.wait(timeout=30)
        import moto.settings

        moto.settings.INITIAL_NO_AUTH_ACTION_COUNT = float("inf")


__all__ = ["BUCKET", "PROFILES", "MscStore", "free_port", "msc_config", "msc_store"]
