"""rewards: see docs/design.md."""
