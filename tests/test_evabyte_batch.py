"""EvaByte decodes many prompts at once, each row exactly as it decodes alone.

Needs EvaByte's real remote code, which is never committed: ``MTPC_EVABYTE_CODE=<dir with
evabyte_hf/*.py>`` (OpenEvaByte/evabyte @ 432331a); skipped otherwise. A tiny random checkpoint
of it (``scripts/check_remote_code.py``) has an EVA window of 16 and chunks of 4, so rows of
prompts of 1..40 bytes cross window boundaries (and compress their windows into chunk RFAs)
at their own steps. Rows end at stop ids and give their places to waiting prompts
(continuous batching). Every field of every row of a batch of 1, 3 or 8 equals the prompt
decoded alone: greedy, sampled (each row its own seed), chains and token trees. The rows run
on the static engine, uncompiled (``mtpc.decoding.static_eva``; that no row reads another's
window or RFAs, or its own stale slots: tests/test_evabyte_static.py). The triton path
(triton's CPU interpreter) is a slow test.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from typing import Any

import pytest
import torch

import mtpc
from mtpc.model import MTPCModel
from tests.helpers import (
    evabyte_checkpoint,
    needs_evabyte_code,
    run_under_triton_interpreter,
)

pytestmark = [needs_evabyte_code, pytest.mark.usefixtures("one_thread")]

STOPS = (5, 7)
W, C = 16, 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return evabyte_checkpoint(tmp_path_factory.mktemp("eva"), window_size=W, chunk_size=C)


def load(folder: Path, kind: str = "cp", lora_layers: int = 1) -> MTPCModel:
    from mtpc.backbones import load_backbone

    backbone = load_backbone(
        "evabyte", path=str(folder), dtype="float32", device="cpu", attention_impl="torch"
    )
    built = MTPCModel.from_backbone(backbone, kind, 4, 2, lora_layers=lora_layers)
    if lora_layers:
        with torch.no_grad():
            for p in built.backbone.lora.parameters():
                p.normal_(0, 0.05)
    return built


@pytest.fixture(scope="module")
def model(folder: Path) -> MTPCModel:
    return load(folder)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts: of 16, 32 and 15 bytes (a full window at the prefill: compressed at
    once; one short of it), then of random lengths 1..40."""
    rng = random.Random(seed)
    lengths = [16, 32, 15] + [rng.randint(1, 40) for _ in range(count - 3)]
    return [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]


def fields(res: Any) -> tuple:
    return res.tokens, res.accepted, res.emitted, res.drafted, res.trunk_passes, res.stopped


def alone(model: MTPCModel, items: list[list[int]], new: int, **kw: Any) -> list[tuple]:
    return [
        fields(mtpc.generate(model, p, new, seed=i, stop_ids=STOPS, **kw))
        for i, p in enumerate(items)
    ]


def batched(model: MTPCModel, items: list[list[int]], new: int, size: int, **kw: Any) -> list:
    seeds = list(range(len(items)))
    out = mtpc.generate(model, items, new, seed=seeds, stop_ids=STOPS, batch_size=size, **kw)
    assert isinstance(out, list)
    return [fields(res) for res in out]


@pytest.mark.parametrize(
    "kw",
    [{}, {"greedy": False}, {"tree_budget": 6}, {"greedy": False, "tree_budget": 5}],
    ids=["greedy", "sampled", "tree", "sampled-tree"],
)
def test_every_row_of_a_batch_equals_its_decoding_alone(model: MTPCModel, kw: dict) -> None:
    items = prompts(9)
    want = alone(model, items, 40, **kw)
    if not kw:  # a row ends early (a stop id); rows are replaced at every B < 9 anyway
        assert any(len(row[0]) < 40 for row in want)
    for size in (1, 3, 8):
        assert batched(model, items, 40, size, **kw) == want, size


def test_a_draft_without_lora_batches_equal_alone(folder: Path) -> None:
    """k = 0 (the tails are empty: the trunk's cache only), greedy and sampled."""
    plain = load(folder, "btree", lora_layers=0)
    items = prompts(6, seed=2)
    for kw in ({}, {"greedy": False}):
        assert batched(plain, items, 30, 4, **kw) == alone(plain, items, 30, **kw)


@pytest.mark.parametrize(
    "kw",
    [{"policy": "recompute"}, {"policy": "drop"}, {"method": "autoregressive"}],
    ids=["recompute", "drop", "autoregressive"],
)
def test_other_policies_and_autoregressive_batches_equal_alone(model: MTPCModel, kw: dict) -> None:
    items = prompts(5, seed=1)
    assert batched(model, items, 30, 3, **kw) == alone(model, items, 30, **kw)


def test_batches_run_on_the_uncompiled_static_engine(
    model: MTPCModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without ``compile=``, a batch's passes go to the static engine's layout, whose step is
    never handed to torch.compile; a prompt admitted with fewer than half the rows is
    prefilled alone (no pass of the engine's prefill chunk: B rows per chunk for it) and
    adopted; B = 1 stays in the model's own caches."""
    from mtpc.decoding import static, static_step

    passes, widths, admissions = [], [], []
    original, run, admit = (
        static.StaticLayout.target,
        static_step.StaticEngine.run,
        static.StaticLayout.admit,
    )

    def target(self: Any, *args: Any, **kw: Any) -> Any:
        passes.append(self.engine.backend)
        return original(self, *args, **kw)

    def engine_run(self: Any, ids: torch.Tensor, *args: Any) -> Any:
        widths.append(ids.shape[1])
        return run(self, ids, *args)

    def spy(self: Any, rows: Any, prompts: Any) -> Any:
        widths.clear()
        out = admit(self, rows, prompts)
        admissions.append((len(rows), static_step.PREFILL_CHUNK in widths))
        return out

    monkeypatch.setattr(static_step.StaticEngine, "run", engine_run)
    monkeypatch.setattr(static.StaticLayout, "admit", spy)

    def never(*args: Any) -> Any:
        raise AssertionError("the uncompiled engine's step went to torch.compile")

    monkeypatch.setattr(static.StaticLayout, "target", target)
    monkeypatch.setattr(static_step, "compile_step", never)
    out = mtpc.generate(model, prompts(5), 12, batch_size=4, seed=[0, 1, 2, 3, 4])
    assert passes and set(passes) == {None}
    assert admissions[0] == (4, True)  # the first four together: every row real
    assert (1, False) in admissions and (1, True) not in admissions  # one row: alone
    assert {r.engine for r in out} == {"eager"}
    passes.clear()
    mtpc.generate(model, prompts(4)[0], 12)
    assert not passes


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_path_batches_equal_alone_under_the_interpreter(tmp_path: Path) -> None:
    """EvaByte's triton path (its prefill kernels and window compression, triton's CPU
    interpreter, window 128 as the kernels' blocks need): batch 2 of 3 rows == alone."""
    run_under_triton_interpreter(tmp_path, TRITON_SCRIPT)


TRITON_SCRIPT = """
import random
import torch
import mtpc
from mtpc.backbones import load_backbone
from mtpc.model import MTPCModel
backbone = load_backbone(
    "evabyte", path={path!r}, dtype="float32", device="cpu", attention_impl="triton"
)
assert backbone.use_triton
model = MTPCModel.from_backbone(backbone, "cp", 4, 2, lora_layers=1)
with torch.no_grad():
    for p in model.backbone.lora.parameters():
        p.normal_(0, 0.05)
rng = random.Random(0)
items = [[rng.randrange(3, 300) for _ in range(rng.randint(100, 140))] for _ in range(3)]
fields = lambda r: (r.tokens, r.accepted, r.trunk_passes)
for kw in ({{}}, {{"greedy": False, "tree_budget": 5}}):
    want = [fields(mtpc.generate(model, p, 40, seed=i, stop_ids=(5, 7), **kw))
            for i, p in enumerate(items)]
    got = [fields(r) for r in mtpc.generate(model, items, 40, seed=[0, 1, 2], stop_ids=(5, 7),
                                            batch_size=2, **kw)]
    print(kw, [len(w[0]) for w in want], got == want)
    assert got == want, kw
print("equal")
"""
