"""What a shared store may be trusted with: names that reveal nothing, values that prove
who wrote them.

Anyone who can write a Redis/Valkey keyspace can put any bytes under any name. Replicas
given one shared secret (``KVRT_REMOTE_SECRET``, or the file ``remote.secret_file``
names) therefore:

- *name* every value with a keyed hash of what it holds (a block's key, a reply's text):
  a name says nothing of the model, the tokens or the tenant, and cannot be computed, so
  a value cannot be planted under it before a replica writes it;
- *seal* every value with an HMAC-SHA256 tag over its name and its bytes: a value that
  was altered, moved under another name or written without the secret fails the check
  and is never used (the caller counts it, drops it and computes instead).

Without a secret the store trusts every writer: names are plain hashes and values carry
no tag. The runtime says so when it opens. The transport's half of the boundary (who may
connect, and whether the bytes are read on the way) is the server's: an ACL user and TLS
(``rediss://`` with ``remote.ca_file``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from pathlib import Path

from .._checks import read_small_file
from .._errors import ConfigError, KvrtError

__all__ = ["SECRET_ENV", "ForgedValueError", "Signer", "load_secret"]

SECRET_ENV = "KVRT_REMOTE_SECRET"
"""The environment variable holding the shared secret itself (never a flag: a command
line is visible to every user of the host)."""

MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
"""The largest secret file read (a secret is a line of text; a device such as
``/dev/zero`` is refused before it is read)."""
TAG_BYTES = 32
NAME_SPACE = "kvrt:v2"
"""Every name kvrt writes begins with this (the version of the names and values)."""


class ForgedValueError(KvrtError):
    """A value in a shared store fails its tag: altered, moved or written without the
    secret. Never used."""


def load_secret(secret_file: str | None, env: Mapping[str, str] | None = None) -> bytes | None:
    """The shared secret from ``KVRT_REMOTE_SECRET`` or ``secret_file`` (one of them), or
    None when neither is set. A secret shorter than 16 bytes, an unreadable file or both
    sources at once is a :class:`~kvrt.ConfigError`."""
    env = os.environ if env is None else env
    given = env.get(SECRET_ENV, "")
    if given and secret_file:
        raise ConfigError(
            f"the remote secret is given twice ({SECRET_ENV} and remote.secret_file): keep one"
        )
    if secret_file:
        path = Path(secret_file).expanduser()
        raw = read_small_file(path, MAX_SECRET_BYTES, "remote.secret_file")
        secret, where = raw.strip(), f"remote.secret_file {path}"
    elif given:
        # Any bytes make a secret: the environment's own, as the process received them.
        secret, where = os.fsencode(given.strip()), SECRET_ENV
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"the remote secret from {where} is {len(secret)} bytes: give at least "
            f"{MIN_SECRET_BYTES} (e.g. the output of `openssl rand -hex 32`)"
        )
    return secret


class Signer:
    """Names and tags values for one shared store; without a secret, plain hashes and
    no tags (the store trusts every writer).

    >>> signer = Signer(b"0123456789abcdef0123")
    >>> name = signer.name("b", b"what the value holds")
    >>> sealed = signer.seal(name, b"value")
    >>> signer.open(name, sealed)
    b'value'
    >>> signer.open(signer.name("b", b"another"), sealed)
    Traceback (most recent call last):
    ...
    kvrt._cold.trust.ForgedValueError: the value's tag does not match: written without the secret, altered or moved
    """

    def __init__(self, secret: bytes | None) -> None:
        self.signed = secret is not None
        self._names = self._values = b""
        if secret is not None:
            self._names = hmac.digest(secret, b"kvrt names", "sha256")
            self._values = hmac.digest(secret, b"kvrt values", "sha256")

    @property
    def tag_bytes(self) -> int:
        """Bytes a sealed value has beyond its own."""
        return TAG_BYTES if self.signed else 0

    def name(self, kind: str, ident: bytes) -> str:
        """The name of a value of ``kind`` holding what ``ident`` identifies."""
        if self.signed:
            digest = hmac.digest(self._names, kind.encode() + b"\0" + ident, "sha256")
        else:
            digest = hashlib.sha256(kind.encode() + b"\0" + ident).digest()
        return f"{NAME_SPACE}:{kind}:{digest[:20].hex()}"

    def seal(self, name: str, *parts: bytes | memoryview) -> bytes:
        """The stored form of the value ``parts`` make, under ``name``: the parts followed
        by their tag (the parts alone without a secret)."""
        if not self.signed:
            return b"".join(parts)
        mac = hmac.new(self._values, name.encode() + b"\0", "sha256")
        for part in parts:
            mac.update(part)
        return b"".join(parts) + mac.digest()

    def open(self, name: str, stored: bytes | memoryview) -> memoryview:
        """The value sealed in ``stored`` under ``name`` (a view, not copied); raises
        :class:`ForgedValueError` when the tag does not match."""
        view = memoryview(stored).cast("B")
        if not self.signed:
            return view
        if view.nbytes < TAG_BYTES:
            raise ForgedValueError("the value is shorter than its tag")
        body, tag = view[:-TAG_BYTES], view[-TAG_BYTES:]
        mac = hmac.new(self._values, name.encode() + b"\0", "sha256")
        mac.update(body)
        if not hmac.compare_digest(mac.digest(), tag):
            raise ForgedValueError(
                "the value's tag does not match: written without the secret, altered or moved"
            )
        return body
