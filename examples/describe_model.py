"""Describe the embedded model and the capacity kvrt resolves for it on this machine.

python examples/describe_model.py
"""

from __future__ import annotations

import kvrt


def main() -> None:
    config = kvrt.load_config()  # $KVRT_CONFIG and KVRT_* variables apply
    info = kvrt.describe_model(config)
    m, c = info.model, info.capacity
    print(f"{m.name}: {m.n_layers} layers, {m.n_head_kv} KV heads x {m.head_dim}, {m.kv_type} KV")
    print(f"KV bytes per token: {m.kv_bytes_per_token:,}")
    print(f"hot window: {c.hot_context_tokens:,} tokens (limited by {', '.join(c.hot_limited_by)})")
    print(
        f"planner context: {c.planner_effective_context:,} tokens; cold store: {c.cold_store_tokens:,} tokens"
    )


if __name__ == "__main__":
    main()
