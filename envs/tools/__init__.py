"""Tools the agent calls (search, visit) and the toolbox that runs them safely."""
