"""Pluggable decision objects: pure, synchronous, no I/O, no clock reads.

Each policy answers one question (which block to evict next, whether a block earns a
KV-byte slot, whether restoring beats recomputing) from a frozen snapshot handed to it,
and is registered here by name so configuration can pick it.
"""
