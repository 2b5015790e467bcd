"""A real S3-compatible server on loopback for the remote-tier tests (moto's server mode).

``S3Server`` runs ``moto.server.ThreadedMotoServer`` on 127.0.0.1 and a free port, in
this process. ``stop()`` / ``start()`` take it down and bring it back *on the same port*
with its buckets and objects intact (moto keeps state per process), so a test can cut the
store off mid-run and then look at what was left behind.
"""

from __future__ import annotations

import socket
import time

HOST = "127.0.0.1"
KEY = SECRET = "testing"
REGION = "us-east-1"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class S3Server:
    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self._server = None

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self) -> S3Server:
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request

        deadline = time.monotonic() + 10
        while True:
            srv = ThreadedMotoServer(ip_address=HOST, port=self.port, verbose=False)
            try:
                srv.start()
                break
            except OSError:  # the port is still in TIME_WAIT after a stop
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        self._server = srv
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def storage_options(self, fast_fail: bool = True) -> dict:
        """s3fs options for this server (``fast_fail``: no retry storms when it is down)."""
        config = {"connect_timeout": 2, "read_timeout": 10}
        if fast_fail:
            config["retries"] = {"max_attempts": 1, "mode": "standard"}
        opts: dict = {
            "key": KEY, "secret": SECRET,
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": REGION},
            "config_kwargs": config,
        }
        return opts

    def boto3_client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id=KEY, aws_secret_access_key=SECRET)

    def make_bucket(self, name: str) -> None:
        self.boto3_client().create_bucket(Bucket=name)
