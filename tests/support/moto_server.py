"""moto's standalone server on loopback: AWS at the HTTP boundary for commands the tests start as subprocesses
(a killed export and its rerun, Slurm jobs), which an in-process `mock_aws` cannot reach."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def moto_endpoint() -> Iterator[str]:
    """The endpoint URL (for AWS_ENDPOINT_URL) of a moto server on 127.0.0.1 and a free port, stopped on exit."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()
