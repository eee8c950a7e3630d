"""How ``kvrt serve`` serves a runtime (:class:`ServeConfig`), the model id it answers to,
and the scope a request may reuse within."""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec

import kvrt

from .state import Bounds

__all__ = ["MIN_STORE_BYTES", "PIN_HEADER", "ServeConfig", "model_id", "reuse_scope"]

MIN_STORE_BYTES = 4096
"""The least a tenant's kept responses or conversations may take."""


class ServeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How ``kvrt serve`` serves a runtime."""

    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 8000
    """Port to listen on."""
    max_sessions: int = 4
    """Sessions kept live at once (each holds a hot window)."""
    max_queue: int = 16
    """Requests that may wait for a session; past it a request gets 429."""
    idle_sessions: int | None = None
    """Idle sessions kept live when a request takes a session and no other is being
    served (default: all, up to ``max_sessions``). With a number, the others, least
    recently used first, put their hot windows in the cold store and free their contexts:
    agents taking turns then hold one session's memory, and a conversation that comes
    back is restored from the cold store (exact, at memory speed). Conversations sent at
    once keep theirs."""
    hot_tokens: int | None = None
    """Each session's hot window (default: the runtime's)."""
    model_name: str | None = None
    """The model id clients send (default: the model file's name)."""
    default_max_tokens: int = 512
    """Tokens generated when a request gives no ``max_tokens``."""
    retry_after: int = 1
    """Seconds a refused (429) request is told to wait."""
    stall_timeout: float = 30.0
    """Seconds a streaming client may hold bytes it has not taken; past it the stream is
    closed and the session goes back to the pool, however slow the engine (what the client
    has taken is read from its connection on Linux; elsewhere, once the send buffer and
    the client's receive buffer are full)."""
    send_buffer: int = 65536
    """Bytes of each connection's socket send buffer (``SO_SNDBUF``; the kernel may
    double it)."""
    api_key: str | None = None
    """When set, every route but ``/health`` requires ``Authorization: Bearer <key>``
    (compared in constant time); others get a 401. One key is one tenant (``default``)."""
    response_store_bytes: int = 64 * 2**20
    """What a tenant's kept responses (for ``previous_response_id``) may take, in bytes;
    the least recently used go first (also past ``state_bounds.responses`` of them, or
    unused for ``state_bounds.response_age``)."""
    conversation_store_bytes: int = 256 * 2**20
    """What a tenant's conversations may take, in bytes; past it items are refused
    (a 507 naming the bound) until some are deleted."""
    state_path: str | None = None
    """The SQLite database of kept responses and conversations, so they outlive restarts
    (``kvrt serve``'s default: ``$KVRT_CACHE_DIR/state.sqlite3``, beside the disk tier's
    blocks); None keeps them in this process's memory. With the runtime's ``remote.url``
    they live on that server instead, shared by every replica."""
    state_bounds: Bounds = msgspec.field(default_factory=Bounds)
    """Per-tenant counts and ages of kept responses and conversations (their bytes are
    ``response_store_bytes`` and ``conversation_store_bytes``)."""
    max_grammar_bytes: int = 256 * 1024
    """The largest JSON Schema (a response format, a tool's parameters) compiled for a
    request, in bytes of JSON; larger ones are a 400 before anything is compiled."""
    grammar_timeout: float = 10.0
    """Seconds reading a request and compiling its grammars may take (in a worker thread,
    never on the event loop); past them the request is a 400."""
    api_keys: dict[str, str] = msgspec.field(default_factory=dict)
    """Keys accepted, each with the tenant it names (``{key: tenant}``; several keys may
    name one tenant). Reuse of every kind (a session's hot KV, cold blocks in RAM, on disk
    and in Redis, remembered replies, stored responses) happens only within a tenant, and
    a request's ``cache_salt`` narrows it further. No key and no salt: everything is
    shared (one user's machine)."""

    def __post_init__(self) -> None:
        for flag, field in (
            ("--response-store", "response_store_bytes"),
            ("--conversation-store", "conversation_store_bytes"),
        ):
            value = getattr(self, field)
            if value < MIN_STORE_BYTES:
                raise kvrt.ConfigError(
                    f"{flag} (ServeConfig.{field}) is {value:,} bytes: a store this small "
                    f"keeps nothing, and each response would be refused after it was "
                    f"computed; give at least {MIN_STORE_BYTES:,}"
                )

    @property
    def bounds(self) -> Bounds:
        """What the state store keeps for each tenant: ``state_bounds`` with the store
        sizes set."""
        return msgspec.structs.replace(
            self.state_bounds,
            response_bytes=self.response_store_bytes,
            conversation_bytes=self.conversation_store_bytes,
        )

    def tenants(self) -> dict[str, str]:
        """Every key accepted, with its tenant."""
        keys = dict(self.api_keys)
        if self.api_key:
            keys.setdefault(self.api_key, "default")
        return keys


PIN_HEADER = "x-session-id"


def reuse_scope(tenant: str | None, salt: str | None) -> str | None:
    """What a request may reuse with: requests of its tenant and cache salt alone, as the
    cache salt of the sessions serving them (a digest: any tenant name and salt make a
    valid one). None where there is neither: everything is shared."""
    if tenant is None and salt is None:
        return None
    h = hashlib.blake2b(msgspec.json.encode([tenant, salt]), digest_size=16)
    return h.hexdigest()


def model_id(runtime: kvrt.Runtime, config: ServeConfig) -> str:
    """The model id the server serves (``/v1/models``) and clients send."""
    return config.model_name or Path(runtime.model_info.model.path).stem
