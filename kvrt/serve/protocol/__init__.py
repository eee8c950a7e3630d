"""One translator per API surface, pure: a request body read into one typed kvrt call
(:class:`Call`), and the call's result written as that API's body or events. No server,
no event loop, no locks here (the shape of h11): the app routes, authenticates, lends
sessions and streams; these say what the bytes mean.

- :mod:`.conversations`: the Conversations API's items and metadata
- :mod:`.responses`: the Responses API (``read_request``, ``responses_call``,
  ``response_body``, ``ResponseEvents``)
- :mod:`.chat`: Chat Completions and Completions (``read_chat``, ``read_completion``,
  ``chat_response``, ``chunk`` ...)
- :mod:`.call`: the call every surface reads into, and the limits it is checked against
- :mod:`.errors`: a refusal as the API answers it; kvrt's errors read by their ``param``

Dependencies run one way, in the order of :data:`LAYERS`; the architecture test holds it.
"""

from __future__ import annotations

from .call import Call, Limits
from .errors import MAX_BODY, RequestError, error_body, refusal

__all__ = ["MAX_BODY", "Call", "Limits", "RequestError", "error_body", "refusal"]

LAYERS = (
    "conversations",
    "responses",
    "chat",
    "call",
    "errors",
)
"""The modules from the top down: each imports only those after it."""
