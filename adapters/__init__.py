"""Engine adapters: one package per engine, each implementing :mod:`kvrt.backend`.

``kvrt.adapters.llama`` drives llama.cpp through ``kvrt.native_bridge.llama``;
``kvrt.adapters.openvino`` drives a stateful OpenVINO IR. Adapters are synchronous; kvrt's
runtime calls them from worker threads. They import only :mod:`kvrt.backend`, kvrt's public
errors and the native bridge. What they share: the record of a window's resident tokens
and its rules (:mod:`._window`), what a window is given, checked (:mod:`._given`), key
sketches for relevance (:mod:`._sketch`) and the one place bridge errors become kvrt
errors (:mod:`._errors`), in the order of :data:`LAYERS`.
"""

LAYERS = (
    "_window",
    "_given",
    "_sketch",
    "_errors",
)
"""The modules from the top down: each imports only those after it."""
