"""EvaByte at scale: decoding writes only new window slots, the triton cache is sized from the
batch run, and the EVA attention path is chosen for the device the model will run on.

The window-slot count wraps the window buffers of every :class:`EvaWindowCache` in a tensor
subclass that counts the slots (along the window axis) each in-place write covers; the
one-pass path writes a pass's new positions itself, so a decoding step must write about what
it passes, never the whole window (the kept prefix stays in place, as EvaByte's own
``multi_byte_pred_update_cache`` leaves it).
"""

from __future__ import annotations

import logging
import sys
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch

import mtpc
from mtpc.backbones import evabyte as evabyte_module
from mtpc.backbones import remote_code, run_device_for
from mtpc.model import MTPCModel
from tests.fakes import fake_evabyte

W, C, V = 32, 4, 320


class SlotCounter(torch.Tensor):
    """A window buffer (B, h, W + room, hd) that counts the window slots each write covers."""

    writes: list[int]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.__setitem__:
            target, index = args[0], args[1]
            slots = index[2] if isinstance(index, tuple) and len(index) > 2 else None
            size = target.shape[2]
            if isinstance(slots, slice):
                count = len(range(*slots.indices(size)))
            elif isinstance(slots, torch.Tensor):
                count = int(slots.numel())
            else:  # the whole buffer
                count = size
            SlotCounter.writes.append(count)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))  # plain tensors out: nothing else is counted


@pytest.fixture
def slot_writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    SlotCounter.writes = []
    init = evabyte_module.EvaWindowCache.__init__

    def counting_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        for layer in self.layers:
            self.past_window_k[layer] = self.past_window_k[layer].as_subclass(SlotCounter)
            self.past_window_v[layer] = self.past_window_v[layer].as_subclass(SlotCounter)

    monkeypatch.setattr(evabyte_module.EvaWindowCache, "__init__", counting_init)
    return SlotCounter.writes


def eva_model(k: int = 0, window: int = 4) -> MTPCModel:
    torch.manual_seed(0)
    hf = fake_evabyte(3, window_size=W, chunk_size=C)
    return MTPCModel.from_hf(hf, kind="cp", window=window, rank=2, lora_layers=k)


def test_autoregressive_steps_write_one_window_slot_each(slot_writes: list[int]) -> None:
    """Each AR step writes its one new slot per layer (K and V); the kept ones stay put."""
    model = eva_model()
    prompt = torch.randint(0, V, (11,)).tolist()
    res = mtpc.generate(model, prompt, max_new_tokens=3 * W, method="autoregressive")
    layers = model.backbone.num_layers
    assert slot_writes[: 2 * layers] == [len(prompt)] * (2 * layers)  # the prefill pass
    steps = slot_writes[2 * layers :]
    assert max(steps) == 1, f"a decoding step wrote {max(steps)} window slots (a window copy)"
    # one write per layer, K and V, per fed position (the last new id is never fed)
    assert len(steps) == 2 * layers * (len(res.tokens) - 1)


@pytest.mark.parametrize("tree_budget", [None, 8])
def test_speculative_cycles_write_about_what_they_verify(
    slot_writes: list[int], monkeypatch: pytest.MonkeyPatch, tree_budget: int | None
) -> None:
    """Greedy SD (a chain, a token tree): window slots written <= 2 x positions passed (the
    pass's own writes plus at most one move per kept position), output still equal to AR."""
    model = eva_model(k=1, window=6)
    backbone = model.backbone
    passed = [0]
    run_pass = backbone._pass

    def counting_pass(hidden: torch.Tensor, start: int, end: int, *args: Any) -> torch.Tensor:
        passed[0] += 2 * hidden.shape[1] * (end - start)  # K and V of every layer
        return run_pass(hidden, start, end, *args)

    monkeypatch.setattr(backbone, "_pass", counting_pass)
    prompt = torch.randint(0, V, (9,)).tolist()
    ar = mtpc.generate(model, prompt, max_new_tokens=3 * W, method="autoregressive")
    slot_writes.clear()
    passed[0] = 0
    sd = mtpc.generate(model, prompt, max_new_tokens=3 * W, tree_budget=tree_budget)
    assert sd.tokens == ar.tokens
    assert passed[0] > 0
    assert sum(slot_writes) <= 2 * passed[0], (sum(slot_writes), passed[0])


def test_compact_moves_only_the_kept_new_slots(slot_writes: list[int]) -> None:
    """A tree's path [0, 1, 3] after 10 kept positions: slots 10, 11 stay, slot 13 moves."""
    model = eva_model()
    caches = model.new_caches()
    model.trunk(torch.randint(0, V, (1, 10)), caches.trunk)
    nodes = torch.randint(0, V, (1, 4))
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    model.trunk(nodes, caches.trunk, positions=10 + torch.tensor([0, 1, 1, 2]), tree_mask=tree)
    slot_writes.clear()
    native = caches.trunk.native
    before = native.past_window_k[0][:, :, 13].clone()
    caches.trunk.compact(10, torch.tensor([0, 1, 3]))
    assert slot_writes == [1] * (2 * model.backbone.num_layers)
    torch.testing.assert_close(native.past_window_k[0][:, :, 12], before, rtol=0, atol=0)
    assert len(caches.trunk) == 13 and native.past_window_pos[0] == 13


# ---------------------------------------------------------------- item: batch, device ----
class _RecordingTritonCache:
    """Stands in for the remote ``EvaStaticCacheForTriton``: records the batch it is built for."""

    batches: ClassVar[list[int]] = []

    def __init__(self, batch: int, heads: int, window: int, hd: int, layers: int, *_: Any) -> None:
        _RecordingTritonCache.batches.append(batch)
        self.past_window_k = [torch.zeros(batch, heads, window, hd) for _ in range(layers)]
        self.past_window_v = [torch.zeros(batch, heads, window, hd) for _ in range(layers)]
        self.past_window_pos: list[int] = []
        self.rfa_k: list[Any] = []
        self.rfa_v: list[Any] = []
        self._seen_tokens = 0


def test_cache_free_run_sizes_the_triton_cache_from_its_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``data.batch_size=4``: the throwaway triton cache of a training forward has 4 rows."""
    backbone = eva_model().backbone
    _RecordingTritonCache.batches = []
    seen: list[Any] = []
    monkeypatch.setattr(backbone, "use_triton", True)
    monkeypatch.setattr(
        backbone, "remote", SimpleNamespace(EvaStaticCacheForTriton=_RecordingTritonCache)
    )

    def run_remote(hidden: torch.Tensor, start: int, end: int, positions: Any, remote: Any) -> Any:
        seen.append(remote)
        return hidden

    monkeypatch.setattr(backbone, "_run_remote", run_remote)
    hidden = torch.zeros(4, 2 * W, backbone.hidden_size)  # (B=4, T, d)
    backbone.run_layers(hidden, 0, backbone.num_layers)
    assert _RecordingTritonCache.batches == [4]
    assert seen[0].past_window_k[0].shape[0] == 4


def test_run_device_for_the_trainer_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert run_device_for("cpu") == "cpu"
    assert run_device_for("gpu") == "cuda:0" and run_device_for("cuda") == "cuda:0"
    monkeypatch.setenv("LOCAL_RANK", "3")  # a DDP rank runs on its own GPU
    assert run_device_for("gpu") == "cuda:3"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run_device_for("auto") == "cpu" and run_device_for(None) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert run_device_for("auto") == "cuda:3"


def test_attention_path_follows_the_run_device_not_the_load_device(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Loaded on the CPU for a GPU run: ``auto`` takes the triton path and ``triton`` is not
    refused; the log names both devices. (A stand-in triton package; no kernel runs.)"""
    from tests.fake_checkpoints import eva_checkpoint, stand_in_triton

    stand_in_triton(tmp_path, monkeypatch)
    folder, _ = eva_checkpoint(tmp_path, None)
    paths = []
    try:
        with caplog.at_level(logging.INFO, logger="mtpc.backbones.remote_code"):
            for impl, run_device in (("auto", "cuda:0"), ("triton", "cuda:0"), ("auto", "cpu")):
                model = remote_code.load_remote_causal_lm(
                    "evabyte", str(folder), None, torch.float32, "cpu", impl, run_device=run_device
                )
                paths.append(sys.modules[type(model).__module__].USE_TRITON_IMPL)
                assert next(model.parameters()).device.type == "cpu"  # loaded where asked
    finally:
        for name in [n for n in sys.modules if n == "triton" or n.startswith("triton.")]:
            del sys.modules[name]
    assert paths == [True, True, False]
    assert "EVA attention path 'triton' (model.attention_impl=auto, device=cuda:0" in caplog.text
    assert "loaded on cpu" in caplog.text
