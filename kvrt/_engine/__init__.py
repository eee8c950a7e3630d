"""Talking to an engine: the contract an adapter implements (:mod:`.contract`, public as
:mod:`kvrt.backend`), which adapter serves a backend name (:mod:`.registry`), model files
(:mod:`.model_files`), what a machine's memory allows (:mod:`.capacity`, :mod:`.memory`),
whose turn an engine's slot is (:mod:`.turns`) and when an engine frees the context it
keeps for the next session (:mod:`.spare`)."""
