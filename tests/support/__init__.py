"""Helpers the tests share; fixtures live in conftest.py."""
