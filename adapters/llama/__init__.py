"""kvrt's llama.cpp backend: the engine without kvrt, for benchmarks (:mod:`._reference`);
one loaded GGUF model (:mod:`._engine`), what it is as kvrt pages it (:mod:`._facts`) and
its kernel probe (:mod:`._probe`); a window on a model with recurrent layers
(:mod:`._hybrid`), built on the one KV window (:mod:`._context`), which says what it
promises (:mod:`._capabilities`) and is composed of how large its context is
(:mod:`._sizing`), a hybrid's recurrent state kept after block ends (:mod:`._checkpoints`),
its cells as bytes (:mod:`._cells`) and keys read back for relevance (:mod:`._keys`);
windows decoding together (:mod:`._together`); how the model turns its keys
(:mod:`._rope`); and its GGUF metadata (:mod:`._gguf`). Dependencies run one way, in the
order of :data:`LAYERS`; the architecture test holds it."""

from ._context import LlamaEngineContext as LlamaEngineContext
from ._engine import LlamaEngine as LlamaEngine
from ._reference import REFERENCE_NAME as REFERENCE_NAME
from ._reference import reference_greedy_tps as reference_greedy_tps
from ._reference import reference_llama as reference_llama
from ._reference import reference_trace as reference_trace
from ._reference import same_settings as same_settings
from ._reference import same_weights as same_weights

LAYERS = (
    "_reference",
    "_engine",
    "_facts",
    "_probe",
    "_hybrid",
    "_context",
    "_capabilities",
    "_sizing",
    "_checkpoints",
    "_cells",
    "_keys",
    "_together",
    "_rope",
    "_gguf",
)
"""The modules from the top down: each imports only those after it."""
