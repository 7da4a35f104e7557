"""The drafters of ``drafter=hetero`` (configs/drafter/hetero.yaml): a local HF causal LM or
one of the fixture drafters of :mod:`mtpc.evaluation.fixture_drafters`, by name."""

from __future__ import annotations

from typing import Any

FIXTURE_PREFIX = "fixture:"
FIXTURES = ("bpe", "lower", "byte_small")


def load_drafter(model: str, tokenizer: str | None = None, device: str = "cpu") -> tuple[Any, Any]:
    """Resolves ``drafter.model`` / ``drafter.tokenizer`` (configs/drafter/hetero.yaml) to
    (model, tokenizer); ValueError for an unknown fixture name. A fixture is trained on the
    synthetic corpus at first use (run from the repository root)."""
    if model.startswith(FIXTURE_PREFIX):
        name = model.removeprefix(FIXTURE_PREFIX)
        if name not in FIXTURES:
            raise ValueError(f"drafter.model is {model!r}; allowed fixtures: {FIXTURES}")
        from mtpc.evaluation.fixture_drafters import trained_models

        built = trained_models()
        lm = built["byte_small"] if name == "byte_small" else built[f"{name}_lm"]
        tok = built["codec"] if name == "byte_small" else built[name]
        return lm.to(device), tok
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mtpc.backbones.codecs import CODECS, get_codec

    lm = AutoModelForCausalLM.from_pretrained(model).to(device).eval()  # type: ignore[arg-type]
    if tokenizer in CODECS:
        return lm, get_codec(str(tokenizer))
    return lm, AutoTokenizer.from_pretrained(tokenizer or model)
