"""Where a session's blocks live and how they move: every context placed (:mod:`.long`:
through placement where it fits, as windows where it is longer), the hot window's bookkeeping
(:mod:`.window`), the pure placement planner (:mod:`.planner`) and its executor
(:mod:`.placement`), computing blocks (:mod:`.computing`), moving them out and back in
(:mod:`.moves`), the engine gate every call goes through (:mod:`.gate`), what each token's
KV attended to (:mod:`.provenance`), approximate hits (:mod:`.approximate`), relevance
(:mod:`.scoring`, a long context's key sketches packed in :mod:`.sketches`), a context's tokens (:mod:`.tokens`) and what a context is made of
(:mod:`.segments`).

Dependencies run one way, in the order of :data:`LAYERS` (a module imports only those
after it); the architecture test holds it."""

LAYERS = (
    "long",
    "placement",
    "scoring",
    "sketches",
    "approximate",
    "computing",
    "moves",
    "gate",
    "provenance",
    "tokens",
    "window",
    "planner",
    "segments",
)
