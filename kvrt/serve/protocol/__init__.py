"""One translator per API surface, pure: a request body read into one typed kvrt call
(a :class:`~.call.Turn`), and the call's result written as that API's typed body or
events (msgspec Structs). No server, no event loop, no locks here (the shape of h11):
the exchanges (:mod:`kvrt.serve.exchanges`) hand these what they read and keep, the
server lends sessions and streams; these say what the bytes mean.

- :mod:`.conversations`: the Conversations API's items and metadata
- :mod:`.response_events`: the Responses API's event stream (``ResponseEvents``)
- :mod:`.responses`: the Responses API (``read_request``, ``responses_call``,
  ``response_body``)
- :mod:`.chat`: Chat Completions (``read_chat``, ``chat_response``, ``ChatStream``)
- :mod:`.completions`: Completions (``read_completion``, ``completion_response``,
  ``CompletionStream``)
- :mod:`.items`: input items read as chat messages, kept messages listed as items
- :mod:`.call`: the turn every surface reads into, and the limits it is checked against
- :mod:`.wire`: what the surfaces share on the wire: decoding, bounds, ids, usage,
  log-probabilities, pages, server-sent events
- :mod:`.errors`: a refusal as the API answers it; kvrt's errors read by their ``param``

Dependencies run one way, in the order of :data:`LAYERS`; the architecture test holds it.
"""

from __future__ import annotations

from .call import Limits, Turn
from .errors import MAX_BODY, ErrorBody, RequestError, error_body, refusal
from .wire import sse

__all__ = [
    "MAX_BODY",
    "ErrorBody",
    "Limits",
    "RequestError",
    "Turn",
    "error_body",
    "refusal",
    "sse",
]

LAYERS = (
    "conversations",
    "response_events",
    "responses",
    "chat",
    "completions",
    "items",
    "call",
    "wire",
    "errors",
)
"""The modules from the top down: each imports only those after it."""
