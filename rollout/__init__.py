"""rollout: see docs/design.md."""
