"""The doors' old home: the evaluation's settings are declared, read and checked in
``mtpc.evaluation.settings`` (its schema); these names stay importable from here."""

from mtpc.evaluation.settings import EvalConfigError, check_eval_fields

__all__ = ["EvalConfigError", "check_eval_fields"]
