"""Real ``redis-server`` processes for the tests (Debian's package; ``.ci/run`` installs it
when missing): one on a free loopback port per test, stopped after it."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis


@dataclass
class RedisServer:
    url: str
    process: subprocess.Popen[bytes]
    port: int

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_exe() -> str:
    exe = shutil.which("redis-server")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is not installed (.ci/run installs Debian's package)")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    return exe


def start_redis(folder: Path, *args: str, url: str | None = None, **client: Any) -> RedisServer:
    """A ``redis-server`` in ``folder`` on a free port with ``args`` added (``{port}`` in
    them is the port); ``url`` (with ``{port}``) and ``client`` (redis-py options) say how
    to reach it where the arguments change that (an ACL user, TLS)."""
    port = free_port()
    base = [redis_exe(), "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    base += ["--appendonly", "no", "--dir", str(folder)]
    process = subprocess.Popen(
        [*base, *(a.format(port=port) for a in args)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    address = (url or "redis://127.0.0.1:{port}/0").format(port=port)
    probe = redis.Redis.from_url(address, socket_timeout=1, **client)
    for _ in range(200):
        try:
            probe.ping()
            break
        except redis.ConnectionError:
            if process.poll() is not None:
                pytest.fail(f"redis-server exited with {process.returncode}")
            time.sleep(0.05)
        except redis.AuthenticationError:
            break  # up, and refusing who it should
    else:
        process.kill()
        pytest.fail("redis-server did not start")
    return RedisServer(address, process, port)
