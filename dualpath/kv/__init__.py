"""KV-cache model profiles, block layouts, prefix identity and synthetic KV (pure code)."""
