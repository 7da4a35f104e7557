"""Chat data -> packed byte sequences with assistant-only window targets (paper Sec. 4.1).

Pipeline: ``sources`` (and ``synthetic``, ``python_code``) -> ``preprocess`` -> ``cache``
-> ``packing`` -> ``windows`` -> ``datamodule``; ``prompts`` and ``spec_bench`` build
evaluation prompts. See docs/DATA.md.
"""
