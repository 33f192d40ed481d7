"""rollout: see DESIGN.md."""
