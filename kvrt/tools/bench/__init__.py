"""Every benchmark in one place: ``kvrt bench`` (quick and full, with its plot) and the
engine-layer scripts, each printing figures measured side by side in one run.

    kvrt bench [--quick]
    python -m kvrt.tools.bench.engine_figures [--backend openvino]
    python -m kvrt.tools.bench.engine_agreement
"""
