"""Saving a session's context to a file, and resuming it in a later process.

:meth:`Session.save` writes the context's layout — each segment's name, cache class,
score and exact token ids (generated replies included), and the keys of its blocks — to a
JSON file, after copying every hot block to the cold store and waiting for the disk tier
to hold them. ``rt.open_session(resume=path)`` in a later process lays the same tokens out
again: every block the disk (or remote) tier holds is restored, the rest is computed. The
agent then continues without re-sending its context; when it does re-send it, the blocks
match as usual.

Not saved: the KV bytes themselves (they live in the cold tiers, keyed by content: a disk
tier that dropped a block, or no disk tier at all, means computing it again), the logits
kept after an evicted block, the text-to-token memory of replies (a re-sent reply text is
matched by its tokens), counters and policy state.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

import anyio
import msgspec

from .._errors import InvalidArgumentError, InvalidContextError, InvalidTokenError
from .._paging.segments import Placed, Segment
from .._paging.tokens import Prepared
from .._reports import ContextStatus
from .._types import CacheClass
from .actor import Actor, Command, Ensure, Snapshot

Request = Callable[[Command], Awaitable[Any]]
"""A session handle's way to run a command on its actor and await the result."""

__all__ = ["SavedSegment", "SavedSession", "read_saved", "resume_session", "save_session"]


class SavedSegment(msgspec.Struct, frozen=True, kw_only=True):
    """One segment of a saved context."""

    name: str
    """The segment's name in the context."""
    cache_class: CacheClass
    """Its cache class."""
    score: float | None = None
    """Its importance for ``score_lru``, if it had one."""
    tokens: list[int]
    """The exact token ids the session placed (BOS and generated tokens included)."""
    text: str
    """The tokens as text, for reading the file (resuming uses the tokens)."""
    lone: list[int] = []
    """Offsets of the tokens whose KV was computed alone (generated), so a resumed context
    has the same lineage, and the same blocks, as the saved one."""


class SavedSession(msgspec.Struct, frozen=True, kw_only=True):
    """A session's context as :meth:`Session.save` wrote it."""

    format: Literal[1] = 1
    """The file format's version."""
    fingerprint: str
    """The model and KV layout: a saved context resumes only with the same one. (A setting
    of the window that changes the KV, such as the LongRoPE table a window's size picks, is
    not part of it: resumed in another window, those blocks are computed again.)"""
    hot_tokens: int
    """The hot window the session had."""
    segments: list[SavedSegment]
    """The context's segments, in order."""
    blocks: list[str]
    """The digests of its blocks' keys, in order (the disk files' names)."""
    cold_blocks: int
    """Blocks a cold tier held when the file was written."""
    on_disk: int
    """Of those, blocks a tier below RAM (disk, remote) held: what a restart restores."""


async def save_session(
    actor: Actor, request: Request, path: str | os.PathLike[str]
) -> SavedSession:
    """Snapshot the context through ``request``, wait for its blocks to reach the tiers
    below RAM (within the disk tier's flush timeout) and write the file atomically."""
    if actor.window.virtual:
        raise InvalidArgumentError(
            "save() of a long context is not supported: it would keep only the window shown"
        )
    segments, keys = await request(Snapshot())
    cold = actor.cold
    await cold.wait_written(keys, cold.flush_timeout)
    texts = await anyio.to_thread.run_sync(
        lambda: [actor.engine.detokenize(seg[3]) for seg in segments]
    )
    saved = SavedSession(
        fingerprint=actor.engine.facts.fingerprint,
        hot_tokens=actor.ctx.n_ctx,
        segments=[
            SavedSegment(
                name=name, cache_class=cls, score=score, tokens=tokens, text=text, lone=lone
            )
            for (name, cls, score, tokens, lone), text in zip(segments, texts, strict=True)
        ],
        blocks=[k.digest() for k in keys],
        cold_blocks=sum(k in cold for k in keys),
        on_disk=sum(cold.lower_holds(k) for k in keys),
    )
    try:
        await anyio.to_thread.run_sync(_write, Path(path), msgspec.json.encode(saved))
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise InvalidArgumentError(
            f"cannot write the saved session to {path}: {getattr(exc, 'strerror', None) or exc}"
        ) from None
    return saved


def _write(path: Path, data: bytes) -> None:
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with temp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()


MAX_SAVED_BYTES = 256 * 2**20
"""The largest saved session read: token ids and text of a context far larger than any
planner context (a file past it is refused unread)."""


def read_saved(path: str | os.PathLike[str]) -> SavedSession:
    """The saved session in ``path``, or an :class:`InvalidContextError` saying why not.

    Only a regular file of at most :data:`MAX_SAVED_BYTES` is read: the file is opened
    without blocking (a FIFO opens at once) and checked before a byte is read, so a
    FIFO, a device such as ``/dev/zero`` or a huge file is refused at once."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise InvalidContextError(
            f"cannot read the saved session {path}: {getattr(exc, 'strerror', None) or exc}"
        ) from None
    with os.fdopen(fd, "rb", buffering=0) as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidContextError(f"{path} is not a regular file, so not a saved session")
        if st.st_size > MAX_SAVED_BYTES:
            raise InvalidContextError(
                f"{path} holds {st.st_size} bytes, more than a saved session's "
                f"{MAX_SAVED_BYTES}: not a saved kvrt session"
            )
        os.set_blocking(fd, True)
        try:
            raw = f.read(MAX_SAVED_BYTES + 1)
        except OSError as exc:
            raise InvalidContextError(
                f"cannot read the saved session {path}: {exc.strerror or exc}"
            ) from None
    if len(raw) > MAX_SAVED_BYTES:
        raise InvalidContextError(f"{path} grew past {MAX_SAVED_BYTES} bytes while read")
    try:
        return msgspec.json.decode(raw, type=SavedSession)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise InvalidContextError(f"{path} is not a saved kvrt session: {exc}") from None


async def resume_session(actor: Actor, request: Request, saved: SavedSession) -> ContextStatus:
    """Lay ``saved``'s tokens out in the session, restoring what the cold tiers hold."""
    model = actor.engine.facts.fingerprint
    if saved.fingerprint != model:
        raise InvalidContextError(
            "the saved session was made with another model or KV layout "
            f"(fingerprint {saved.fingerprint}, this runtime's is {model})"
        )
    n_vocab = actor.engine.facts.n_vocab
    for seg in saved.segments:
        bad = next((t for t in seg.tokens if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise InvalidTokenError(
                f"the saved segment {seg.name!r} holds token id {bad}, outside the model's "
                f"vocabulary of {n_vocab}"
            )
        if any(not 0 <= i < len(seg.tokens) for i in seg.lone):
            raise InvalidContextError(
                f"the saved segment {seg.name!r} names generated tokens past its end"
            )
    segments = tuple(
        Segment(s.name, s.text, cache_class=s.cache_class, score=s.score) for s in saved.segments
    )
    prepared = Prepared(lambda: None)
    prepared.tokens = {
        (seg.text, i == 0, seg.parse_special, seg.markup): Placed(
            seg, list(s.tokens), frozenset(s.lone)
        )
        for i, (seg, s) in enumerate(zip(segments, saved.segments, strict=True))
    }
    status: ContextStatus = await request(Ensure(segments, prepared))
    return status
