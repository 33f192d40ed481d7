"""Tools for people: the trajectory viewer and a single scripted episode."""
