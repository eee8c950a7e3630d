"""What turns a conversation into tokens and back, with no engine state and no ``await``:
tool calls as a reply carries them (:mod:`.call_formats`; kvrt's JSON envelope for a
model whose template knows no tools, :mod:`.envelope`), tool definitions, choices and
calls (:mod:`.tools`), grammars and the JSON Schemas they enforce (:mod:`.grammar`,
:mod:`.schemas`), chat templates (:mod:`.templates`), sampling (:mod:`.sampling`), stop
sequences (:mod:`.stops`) and the memory of the replies the runtime generated
(:mod:`.replies`).

Dependencies run one way, in the order of :data:`LAYERS`; the architecture test holds it."""

LAYERS = (
    "call_formats",
    "envelope",
    "tools",
    "grammar",
    "schemas",
    "templates",
    "sampling",
    "stops",
    "replies",
)
"""The modules from the top down: each imports only those after it."""
