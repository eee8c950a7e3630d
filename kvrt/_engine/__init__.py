"""Talking to an engine: which adapter serves a backend name (:mod:`.registry`), when an
engine frees the context it keeps for the next session (:mod:`.spare`), whose turn an
engine's slot is (:mod:`.turns`), the contract an adapter implements (:mod:`.contract`,
public as :mod:`kvrt.backend`), what an engine knows of its model (:mod:`.facts`) and its
kernels (:mod:`.kernels`), what a machine's memory allows (:mod:`.memory`,
:mod:`.capacity`), and model files (:mod:`.embedded`, :mod:`.model_files`,
:mod:`.gguf_header`).

Dependencies run one way, in the order of :data:`LAYERS`; the architecture test holds it."""

LAYERS = (
    "registry",
    "spare",
    "turns",
    "contract",
    "facts",
    "kernels",
    "memory",
    "capacity",
    "embedded",
    "model_files",
    "gguf_header",
)
"""The modules from the top down: each imports only those after it."""
