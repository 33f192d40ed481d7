"""The procedural synthetic world: the offline default corpus, its questions and a scripted expert.

- :mod:`.world` generates entities and relations from a seed; :mod:`.render` turns them into pages
  and :class:`~turnstile.envs.search.base.Document` objects; :mod:`turnstile.envs.corpus_server` serves them over HTTP.
- :mod:`.questions` samples multi-hop and aggregation questions with unique answers and clue chains;
  :mod:`.dataset` registers them as the ``synthetic`` dataset kind.
- :mod:`.expert` solves them through the real tools; :mod:`.evaluate` measures that end to end
  (``turnstile expert``).
"""
