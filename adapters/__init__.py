"""Engine adapters: one package per engine, each implementing :mod:`kvrt.backend`.

``kvrt.adapters.llama`` drives llama.cpp through ``kvrt.native_bridge.llama``;
``kvrt.adapters.openvino`` drives a stateful OpenVINO IR. Adapters are synchronous; kvrt's
runtime calls them from worker threads. They import only :mod:`kvrt.backend`, kvrt's public
errors and the native bridge.
"""
