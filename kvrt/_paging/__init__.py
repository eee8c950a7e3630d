"""Where a session's blocks live and how they move.

- :mod:`.long` — every context placed: through placement where it fits, as windows where
  it is longer;
- :mod:`.placement` — the planner's plan carried out (plan -> place -> converge);
- :mod:`.scoring` — relevance, over a long context's key sketches packed in
  :mod:`.sketches`;
- :mod:`.approximate` — approximate hits;
- :mod:`.computing` — tokens computed in batches, or one at a time where they were
  generated;
- :mod:`.moves` — blocks moved out of the window and back in;
- :mod:`.gate` — the engine gate every call goes through;
- :mod:`.provenance` — what each token's KV attended to;
- :mod:`.tokens` — a context's tokens;
- :mod:`.window` — the hot window's bookkeeping (synchronous, no ``await``);
- :mod:`.planner` — the pure placement planner;
- :mod:`.segments` — what a context is made of.

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
