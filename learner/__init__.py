"""learner: see DESIGN.md."""
