"""Engine adapters: one package per engine, each implementing kvrt's backend protocol.

``adapters.llama`` drives llama.cpp through ``native_bridge.llama``. Adapters are
synchronous; kvrt's runtime calls them from worker threads.
"""
