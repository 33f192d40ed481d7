"""learner: see docs/design.md."""
