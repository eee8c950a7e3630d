"""A session: its handle, its actor task and the layers the actor stands on.

Dependencies run one way: ``handle`` (the public :class:`Session`) -> ``saving`` (a
context saved to a file and resumed in a later process) -> ``chat`` (messages to segments
in the model's template) -> ``reply`` (a generation as its caller holds it: pieces, the
completion) -> ``mailbox`` (the one way commands reach the actor, shared by the handle
and its replies) -> ``prefetch`` (the background job a handle starts for its next
context) -> ``actor`` (the mailbox loop, commands, ``explain()``) -> ``generation``
(the continuation, stop sequences, remembered replies) -> ``placement`` (plan -> place ->
converge; ``tokens`` what it places, ``scoring`` relevance, ``approximate`` approximate
hits) -> ``computing`` (tokens computed in batches, or one at a time where they were
generated) -> ``paging`` (evict and export runs, restore runs from any cold tier, room)
-> ``gate`` (engine
calls in threads, derived residency, tallies) -> ``provenance`` (what each token's KV
attended to) -> ``arguments`` (a call's arguments checked) -> ``layout`` (segments and blocks:
synchronous bookkeeping, no ``await``).
"""

from .._paging.gate import SessionParts as SessionParts
from .._paging.gate import SessionPolicies as SessionPolicies
from .._paging.segments import Segment as Segment
from .._paging.tokens import context_tokens as context_tokens
from .._paging.tokens import segment_tokens as segment_tokens
from .._paging.window import HotWindow as HotWindow
from .actor import Actor as Actor
from .handle import Session as Session
from .prefetch import Prefetch as Prefetch
from .reply import Reply as Reply
from .saving import SavedSegment as SavedSegment
from .saving import SavedSession as SavedSession
from .saving import read_saved as read_saved
from .saving import resume_session as resume_session
