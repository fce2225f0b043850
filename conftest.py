"""Repository-wide pytest hooks: tests marked ``cuda`` skip, with the reason, where no CUDA GPU is visible
(``pytest -m cuda`` then reports them as skipped; ``benchmarks/gpu/check.sh`` runs them on a GPU); the
``s3_endpoint`` / ``s3_bucket`` fixtures of the object-store tests (a real S3 server on loopback)."""

import pytest


def pytest_collection_modifyitems(config, items):
    marked = [item for item in items if "cuda" in item.keywords]
    if not marked:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in marked:
        item.add_marker(skip)


_MOTO_SERVER = """
import logging, sys
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
server = ThreadedMotoServer("127.0.0.1", 0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()  # serve until the test session closes this pipe (or dies)
"""


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 endpoint on loopback for the object-store tests: moto's server
    (``moto.server.ThreadedMotoServer``, a dev dependency) on 127.0.0.1 at a free port, in a process of its
    own (in the test's process its threads would wait for the GIL behind the loader's: 0.2 s a request
    instead of 0.01 s), one per session; it exits when the session closes its stdin or dies.

    Yields the environment that points boto (and so ``s3fs``) at it, the variables s3fs reads natively:
    ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``.
    """
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", _MOTO_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        port = proc.stdout.readline().strip()
        if not port.isdigit():
            raise RuntimeError(f"moto server did not start (exit code {proc.poll()})")
        yield {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            "AWS_ACCESS_KEY_ID": "moto-key",
            "AWS_SECRET_ACCESS_KEY": "moto-secret",
            "AWS_DEFAULT_REGION": "us-east-1",
            "NO_PROXY": "127.0.0.1,localhost",  # a CI proxy must not see loopback requests
            "AWS_CONFIG_FILE": "/nonexistent/omni-test-aws-config",  # no profile of the machine's applies
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/omni-test-aws-credentials",
        }
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def s3_bucket(s3_endpoint, monkeypatch):
    """An empty bucket of its own on :func:`s3_endpoint` for one test, with that endpoint's environment set
    in this process (child processes take ``s3_endpoint`` as an argument: a forkserver started earlier
    does not see it). Yields ``(url, env)``: ``url`` is ``s3://<bucket>``."""
    import uuid

    import s3fs

    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(key, raising=False)
    for key, value in s3_endpoint.items():
        monkeypatch.setenv(key, value)
    bucket = f"omni-test-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
    yield f"s3://{bucket}", dict(s3_endpoint)
