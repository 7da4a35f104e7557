"""Chat data -> packed byte sequences with assistant-only window targets (paper Sec. 4.1).

Modules, in pipeline order:

* ``sources``: rows from the Tülu 3 hub dataset, a local dataset of its schema, or the
  synthetic generator (``synthetic``).
* ``preprocess``: validation (malformed rows counted by reason), chat template through the
  codec, context-limit filter, seeded 99 % / 1 % split.
* ``cache``: the on-disk cache of tokenised documents, splits and packing plans.
* ``packing``: deterministic best-fit-decreasing packing with document boundaries.
* ``windows``: targets x_{t+1..t+n}, their mask and the counts V_{i,j} of Eq. 4.
* ``datamodule``: ``MTPCDataModule`` / ``build_datamodule`` (batch format documented there).
* ``prompts``: evaluation prompt sets from the validation split.
"""
