"""kvrt's tools: the ``kvrt`` command line, the demo and the benchmarks.

They are built on kvrt's public API and its core; the core never imports them.
"""
