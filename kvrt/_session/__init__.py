"""A session: its handle, its actor task and what the actor stands on (the paging layers
below live in :mod:`kvrt._paging`).

- :mod:`.handle` — the public :class:`Session`;
- :mod:`.saving` — a context saved to a file and resumed in a later process;
- :mod:`.call` — a chat call read and checked once (:class:`ChatCall`);
- :mod:`.chat` — messages to segments in the model's template;
- :mod:`.reply` — a generation as its caller holds it: pieces, the completion;
- :mod:`.mailbox` — the one way commands reach the actor, shared by the handle and its
  replies;
- :mod:`.prefetch` — the background job a handle starts for its next context;
- :mod:`.actor` — the mailbox loop, the commands, ``explain()``;
- :mod:`.generation` — the continuation, stop sequences, remembered replies;
- :mod:`.arguments` — a call's arguments checked.

Dependencies run one way, in the order of :data:`LAYERS`; the architecture test holds it."""

from .._paging.gate import SessionParts as SessionParts
from .._paging.gate import SessionPolicies as SessionPolicies
from .._paging.segments import Segment as Segment
from .._paging.tokens import context_tokens as context_tokens
from .._paging.tokens import segment_tokens as segment_tokens
from .._paging.window import HotWindow as HotWindow
from .actor import Actor as Actor
from .call import ChatCall as ChatCall
from .handle import Session as Session
from .prefetch import Prefetch as Prefetch
from .reply import Reply as Reply
from .saving import SavedSegment as SavedSegment
from .saving import SavedSession as SavedSession
from .saving import read_saved as read_saved
from .saving import resume_session as resume_session

LAYERS = (
    "handle",
    "saving",
    "call",
    "chat",
    "reply",
    "mailbox",
    "prefetch",
    "actor",
    "generation",
    "arguments",
)
"""The modules from the top down: each imports only those after it."""
