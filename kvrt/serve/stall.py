"""What a streaming client has taken, read from its connection's TCP state.

A client that stops reading a stream holds a session, and the kernel hides it for long:
the client's receive buffer (128 KiB by Linux's default) and the server's send buffer
take every chunk until both are full, which at a slow engine's few hundred bytes a
second takes minutes. So a stream watches its connection instead (Linux ``TCP_INFO``):

- the *right edge* of the client's window (bytes it acknowledged plus the window it
  advertises) moves only as the client makes room, that is, as its application reads;
- the client *holds* what it has not taken while data waits on the server's side (not
  sent, or sent and not acknowledged) or its window is below the largest it advertised
  (its buffer holds unread bytes).

A stream whose client holds bytes and whose right edge has not moved for the stall
timeout has stalled. So that a client that reads nothing is seen holding bytes however
slow the engine, a stream opens with a padding comment (``: ...``, which every SSE
reader skips) larger than a default receive buffer: a reader takes it at once, a
client that never reads is full from the start.

Where the connection cannot be found (not Linux, or a server that hides it), the stream
falls back to what the writes themselves show (a write that waits past the timeout).
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["PADDING", "ClientWatch", "Reading"]

PADDING = 192 * 1024
"""Bytes of the comment a stream opens with: more than a client's default receive buffer
(so one that never reads is seen holding bytes at once), read and skipped by every
client that does."""

_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
# struct tcp_info (include/uapi/linux/tcp.h): offsets of the fields read here.
_BYTES_ACKED = 120
_UNACKED = 24
_NOTSENT = 144
_SND_WND = 228


@dataclass(frozen=True, slots=True)
class Reading:
    """One look at a connection."""

    edge: int
    """Bytes acknowledged plus the window the client advertises now."""
    waiting: int
    """What waits on the server's side: bytes not sent yet plus segments sent and not
    acknowledged (0: nothing)."""
    window: int
    """The window the client advertises now."""


class ClientWatch:
    """The TCP state of one client's connection, and whether it has stalled."""

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self._sock = sock
        self.timeout = timeout
        self._edge = -1
        self._moved = time.monotonic()
        self._widest = 0

    @classmethod
    def of(cls, scope: dict[str, Any], timeout: float) -> ClientWatch | None:
        """The watch of the connection serving ``scope`` (an ASGI HTTP scope), or None
        where it cannot be found."""
        client, server = scope.get("client"), scope.get("server")
        if not client or not server or not hasattr(socket, "TCP_INFO"):
            return None
        try:
            fd = _connection_fd((str(server[0]), int(server[1])), (str(client[0]), int(client[1])))
            if fd is None:
                return None
            sock = socket.socket(fileno=os.dup(fd))
            watch = cls(sock, timeout)
            watch.read()
        except (OSError, ValueError, struct.error):
            return None
        return watch

    def read(self) -> Reading:
        raw = self._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        if len(raw) < _SND_WND + 4:
            raise ValueError("TCP_INFO without the send window")
        acked = _U64.unpack_from(raw, _BYTES_ACKED)[0]
        unacked = _U32.unpack_from(raw, _UNACKED)[0]
        notsent = _U32.unpack_from(raw, _NOTSENT)[0]
        window = _U32.unpack_from(raw, _SND_WND)[0]
        return Reading(edge=acked + window, waiting=unacked + notsent, window=window)

    def stalled(self, *, now: float | None = None) -> bool:
        """Whether the client holds bytes it has not taken and has made no room for the
        stall timeout (a connection gone reads as not stalled: the server sees it go)."""
        now = time.monotonic() if now is None else now
        try:
            seen = self.read()
        except (OSError, ValueError, struct.error):
            return False
        self._widest = max(self._widest, seen.window)
        if seen.edge != self._edge:
            self._edge, self._moved = seen.edge, now
        holding = seen.waiting > 0 or seen.window < self._widest
        if not holding:
            self._moved = now
        return holding and now - self._moved >= self.timeout

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()


def _hex_address(host: str, port: int) -> tuple[str, str] | None:
    """``host:port`` as ``/proc/net/tcp`` (or ``tcp6``) writes it, and which file."""
    try:
        packed = socket.inet_pton(socket.AF_INET, host)
        table = "tcp"
    except OSError:
        try:
            packed = socket.inet_pton(socket.AF_INET6, host)
        except OSError:
            return None
        table = "tcp6"
    words = [packed[i : i + 4] for i in range(0, len(packed), 4)]
    text = "".join(w[::-1].hex().upper() for w in words)  # each 32-bit word as stored
    return f"{text}:{port:04X}", table


def _connection_fd(local: tuple[str, int], remote: tuple[str, int]) -> int | None:
    """The file descriptor of this process's TCP connection from ``local`` to
    ``remote`` (Linux ``/proc``), or None."""
    ours, theirs = _hex_address(*local), _hex_address(*remote)
    if ours is None or theirs is None or ours[1] != theirs[1]:
        return None
    inode = None
    with Path(f"/proc/net/{ours[1]}").open() as table:
        next(table)
        for line in table:
            fields = line.split()
            if fields[1] == ours[0] and fields[2] == theirs[0]:
                inode = fields[9]
                break
    if inode is None:
        return None
    target = f"socket:[{inode}]"
    for entry in os.scandir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(entry.path) == target:
                return int(entry.name)
    return None
