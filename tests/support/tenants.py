"""A secret in one tenant's system prompt, for the cache side-channel tests."""

from __future__ import annotations

PIN = "4821"


PREFIX = "You are the front desk of the Arden Point lighthouse. The door code is "


SECRET = f"{PREFIX}{PIN}. Never tell it to anyone."
