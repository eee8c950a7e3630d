"""The bytes of one cold block outside RAM, the same on disk and in a remote store.

A fixed prefix, a header, then the KV payload::

    magic "KVRTBLK\\0" | version u16 | flags u16 | header length u32 | payload length u64
    | xxh3-128 of header + payload (16 bytes) | header (msgpack) | payload

The header names the key (its fingerprint: the model's, or a salted one), the cache class,
the KV precision, the block's token ids (and which were computed alone), how many float32 logits follow the KV bytes in the
payload (after a block that ended its context; 0 for most) and, under a salted key, the
fingerprint of the KV itself. :func:`decode` refuses anything that does not check out — a wrong magic
or version, lengths that disagree with the bytes, a checksum mismatch, tokens that do not
hash to the key, a key other than the one asked for — so nothing damaged ever reaches an
engine.
"""

from __future__ import annotations

import struct

import msgspec
import numpy as np
import numpy.typing as npt
import xxhash

from .._engine.contract import ColdBlock, ColdBlockMeta
from .._errors import KvrtError
from .._types import CacheClass
from .entry import ColdEntry, ColdKey, token_digest

__all__ = [
    "MAGIC",
    "PREFIX",
    "VERSION",
    "CorruptBlockError",
    "decode",
    "encode",
    "read_block_header",
    "read_prefix",
]

MAGIC = b"KVRTBLK\0"
VERSION = 2
"""2: the key's digests hold which tokens were computed alone (:func:`token_digest`)."""
PREFIX = struct.Struct("<8sHHIQ16s")
"""magic, version, flags, header length, payload length, checksum."""


class CorruptBlockError(KvrtError):
    """Stored block bytes failed a check: never handed to an engine."""


class Header(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    fingerprint: str
    prefix: str
    tokens_digest: str
    start: int
    cache_class: str
    kv_type: str
    tokens: list[int]
    logits: int = 0
    """float32 values after the KV bytes: the logits following the block's last token."""
    kv_fingerprint: str = ""
    """The fingerprint of the KV itself (what an engine checks before loading it), where it
    is not the key's: a salted key (see :func:`~kvrt._cold.entry.salted`)."""
    resumable: bool = True
    """See :attr:`kvrt.backend.ColdBlockMeta.resumable`."""
    lone: list[int] = msgspec.field(default_factory=list)
    """Offsets of the tokens whose KV was computed alone (see :attr:`ColdEntry.lone`)."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Header)


def encode(entry: ColdEntry) -> tuple[bytes, memoryview]:
    """The prefix and header of ``entry``'s stored form, and its payload (not copied)."""
    key, meta = entry.key, entry.meta
    header = _encoder.encode(
        Header(
            fingerprint=key.fingerprint,
            prefix=key.prefix,
            tokens_digest=key.tokens,
            start=key.start,
            cache_class=str(entry.cache_class),
            kv_type=meta.kv_type,
            tokens=list(meta.tokens),
            logits=0 if entry.logits is None else int(entry.logits.size),
            kv_fingerprint="" if meta.fingerprint == key.fingerprint else meta.fingerprint,
            resumable=meta.resumable,
            lone=sorted(entry.lone),
        )
    )
    kv = np.ascontiguousarray(entry.data)
    if entry.logits is not None:
        logits = np.ascontiguousarray(entry.logits, dtype="<f4").view(np.uint8).reshape(-1)
        kv = np.concatenate([kv.reshape(-1), logits])
    payload = kv.data.cast("B")
    h = xxhash.xxh3_128()
    h.update(header)
    h.update(payload)
    prefix = PREFIX.pack(MAGIC, VERSION, 0, len(header), payload.nbytes, h.digest())
    return prefix + header, payload


def read_prefix(raw: bytes) -> tuple[int, int]:
    """Header and payload lengths from a stored block's prefix (no checksum yet)."""
    if len(raw) < PREFIX.size:
        raise CorruptBlockError("truncated: shorter than the block prefix")
    magic, version, _flags, header_len, payload_len, _sum = PREFIX.unpack_from(raw)
    if magic != MAGIC:
        raise CorruptBlockError("not a kvrt block (wrong magic)")
    if version != VERSION:
        raise CorruptBlockError(f"block format version {version}, expected {VERSION}")
    return header_len, payload_len


def read_block_header(raw: bytes) -> Header:
    """The header of a stored block (checked for shape, not against the checksum)."""
    try:
        header = _decoder.decode(raw)
        CacheClass(header.cache_class)
    except (msgspec.DecodeError, ValueError) as exc:
        raise CorruptBlockError(f"unreadable header: {exc}") from None
    return header


def decode(buf: npt.NDArray[np.uint8], expect: ColdKey | None = None) -> ColdEntry:
    """The entry stored in ``buf`` (a whole stored block; its payload is a view of it)."""
    raw = buf.data.cast("B")
    header_len, payload_len = read_prefix(bytes(raw[: PREFIX.size]))
    total = PREFIX.size + header_len + payload_len
    if raw.nbytes != total:
        raise CorruptBlockError(f"{raw.nbytes} bytes where the prefix promises {total}")
    checksum = PREFIX.unpack_from(raw)[5]
    header_bytes = raw[PREFIX.size : PREFIX.size + header_len]
    payload = raw[PREFIX.size + header_len :]
    h = xxhash.xxh3_128()
    h.update(header_bytes)
    h.update(payload)
    if h.digest() != checksum:
        raise CorruptBlockError("checksum mismatch")
    header = read_block_header(bytes(header_bytes))
    cache_class = CacheClass(header.cache_class)
    if any(not 0 <= i < len(header.tokens) for i in header.lone):
        raise CorruptBlockError("the offsets of lone tokens fall outside the block")
    if token_digest(header.tokens, lone=header.lone) != header.tokens_digest:
        raise CorruptBlockError("the token ids do not match the key's token digest")
    key = ColdKey(header.fingerprint, header.prefix, header.tokens_digest, header.start)
    if expect is not None and key != expect:
        raise CorruptBlockError("the block holds another key than the one asked for")
    kv_len = payload_len - 4 * header.logits
    if header.logits < 0 or kv_len < 0:
        raise CorruptBlockError(f"{header.logits} logits do not fit a {payload_len}-byte payload")
    meta = ColdBlockMeta(
        fingerprint=header.kv_fingerprint or header.fingerprint,
        kv_type=header.kv_type,
        start=header.start,
        tokens=tuple(header.tokens),
        n_bytes=kv_len,
        resumable=header.resumable,
    )
    at = PREFIX.size + header_len
    data = buf[at : at + kv_len]
    logits = buf[at + kv_len :].view("<f4").astype(np.float32) if header.logits else None
    return ColdEntry(key, cache_class, ColdBlock(meta, data), logits, frozenset(header.lone))
