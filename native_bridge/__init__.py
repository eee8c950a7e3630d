"""The only code in kvrt that touches C APIs and native memory.

Every wrapper validates its arguments before the native call: an input that would reach a
``GGML_ASSERT`` aborts the whole process, so none may get through. Failures come back as
:class:`BridgeError` subclasses.

The modules: the C allocator's settings (:mod:`.memory`), OpenVINO's public API
(:mod:`.openvino`), several llama.cpp sequences decoded together (:mod:`.llama_batch`),
one llama.cpp context (:mod:`.llama_context`) over a loaded model (:mod:`.llama`), its
sequence state bytes read and rewritten (:mod:`.llama_keys`) and RoPE as ggml applies it
(:mod:`.rope`), on the errors (:mod:`._errors`), in the order of :data:`LAYERS`; the
architecture test holds it.
"""

from ._errors import BridgeArgumentError as BridgeArgumentError
from ._errors import BridgeCallError as BridgeCallError
from ._errors import BridgeError as BridgeError
from ._errors import BridgeLoadError as BridgeLoadError

LAYERS = (
    "memory",
    "openvino",
    "llama_batch",
    "llama_context",
    "llama",
    "llama_keys",
    "rope",
    "_errors",
)
"""The modules from the top down: each imports only those after it."""
