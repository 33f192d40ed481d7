"""Environments, tools, datasets and the synthetic world."""
