"""rewards: see DESIGN.md."""
