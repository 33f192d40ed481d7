"""Recipes that build models from the library (the warm starts); only the ``build-model`` command runs them."""
