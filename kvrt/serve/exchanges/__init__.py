"""One exchange per API surface: what a request of it reads from and keeps in the
server's state, around the pure translation of :mod:`kvrt.serve.protocol` (the shape of
vLLM's serving classes over its protocol). The server lends each exchange a session and
streams its events; it names no surface.

- :mod:`.responses`: ``POST /v1/responses`` (what it continues and keeps), and kept
  responses read back
- :mod:`.conversations`: the Conversations API's routes
- :mod:`.completions`: ``POST /v1/chat/completions`` and ``POST /v1/completions``
- :mod:`.exchange`: what a surface is to the server (:class:`Surface`,
  :class:`Exchange`), what the server lends it (:class:`Desk`), and the base of the
  routes over the state store alone (:class:`StateRoutes`)

Dependencies run one way, in the order of :data:`LAYERS`; the architecture test holds it.
"""

from __future__ import annotations

from .completions import ChatCompletions, Completions
from .conversations import Conversations
from .exchange import Desk, Exchange, StateRoutes, Surface
from .responses import KeptResponses, Responses

__all__ = [
    "ChatCompletions",
    "Completions",
    "Conversations",
    "Desk",
    "Exchange",
    "KeptResponses",
    "Responses",
    "StateRoutes",
    "Surface",
]

LAYERS = (
    "responses",
    "conversations",
    "completions",
    "exchange",
)
"""The modules from the top down: each imports only those after it."""
