"""Information gain (docs/algorithms.md §4) after the fact, in three parts (the rollout measures the
same ``v_s`` on the policy engines while episodes run: ``turnstile.rollout.probes``):

- ``values.py``: what ``v_s`` is (the gold answer's mean log-probability before each turn, from the
  exact ids the policy had) and the boundaries of a trajectory, for any scorer;
- ``scorers.py``: scorers on a transformers model, the KV-cached one (``O(L + T·R)``) and the
  per-prefix reference it is checked against;
- ``plugin.py``: the ``information_gain`` reward plugin, which keeps the values the rollout measured
  or scores each trajectory with the weights that generated it.

Nothing is imported here, so naming the package costs no torch import.
"""
