"""Information gain (docs/algorithms.md §4), in three parts:

- ``values.py``: what ``v_s`` is (the gold answer's mean log-probability before each turn, from the
  exact ids the policy had), the boundaries of a trajectory and the pseudo-response, for any scorer;
- ``scorers.py``: scorers on a transformers model, the KV-cached one (``O(L + T·R)``) and the
  per-prefix reference it is checked against;
- ``plugin.py``: the ``information_gain`` reward plugin, which scores each trajectory with the
  weights that generated it.

Nothing is imported here, so naming the package costs no torch import.
"""
