"""Sequence-level self-distillation (``scripts/regenerate.py``, ``mtpc.regeneration``).

A regenerated assistant turn is the target's own greedy continuation of the regenerated
history (checked against a plain argmax loop over the HF model, autoregressive and
speculative); sampled regeneration has the target's distribution (chi-square against
enumeration on a 4-id vocabulary); shards cover every row once; a SIGKILL mid-run and a
torn last line resume to the uninterrupted output; runs are deterministic; a resume with
other settings is refused; ``train.py`` reads the folder (and a list of paths).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir

from mtpc.backbones.codecs import ByteCodec, get_codec
from mtpc.config import ConfigError
from mtpc.data.sources import load_source
from mtpc.model import MTPCModel
from mtpc.regeneration import (
    RegenerateMismatchError,
    Settings,
    read_folder,
    regenerate,
    regenerate_row,
    regenerate_rows,
    shard_indices,
)
from tests.fakes import chi2_pvalue, exact_distribution, make_target
from tests.helpers import evabyte_checkpoint, needs_evabyte_code

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline"}


def compose_cfg(*overrides: str) -> Any:
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        return compose("regenerate", overrides=["progress=false", *overrides])


def rows_by_index(folder: Path) -> dict[int, dict[str, Any]]:
    rows = read_folder(folder)
    indices = [r["regenerated"]["index"] for r in rows]
    assert len(indices) == len(set(indices)), f"duplicated rows: {Counter(indices)}"
    return {i: r for i, r in zip(indices, rows, strict=True)}


class FourIdCodec(ByteCodec):
    """A 4-id vocabulary: 0 ends a turn (and opens the conversation), 1-3 are a, b, c."""

    name, vocab_size, byte_offset = "four", 4, -96
    pad_id = bos_id = eos_id = eot_id = 0
    special_tokens: Mapping[int, bytes] = {0: b"<eot>"}

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (0,)

    def is_byte(self, token_id: int) -> bool:
        return 1 <= token_id <= 3

    def _prologue(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        return [0]

    def _header(self, role: str) -> list[int]:
        return []


def argmax_continuation(hf: torch.nn.Module, prompt: list[int], stops: Sequence[int], n: int):
    """The target's greedy continuation by full forward passes (no cache, no mtpc code)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            nxt = int(hf(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(nxt)
            if nxt in stops:
                break
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def tiny_model() -> MTPCModel:
    from mtpc.backbones import load_backbone

    return MTPCModel.from_backbone(load_backbone("tiny"), "btree", 4, 2, head_init="stp")


@pytest.mark.parametrize("method", ["autoregressive", "speculative"])
def test_each_turn_is_the_targets_greedy_continuation_of_the_regenerated_history(
    tiny_model: MTPCModel, method: str
) -> None:
    codec = get_codec("tiny")
    row = {
        "id": "r",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 4 + 5?"},
            {"role": "assistant", "content": "this answer is replaced"},
            {"role": "user", "content": "Flip a coin."},
            {"role": "assistant", "content": ""},
        ],
    }
    settings = Settings(method=method, max_new_tokens=40)
    out = regenerate_row(tiny_model, codec, row, 0, settings, 1024).row
    assert out is not None
    hf = tiny_model.backbone.hf_model
    history: list[dict[str, str]] = []
    turns = 0
    for original, message in zip(row["messages"], out["messages"], strict=True):
        assert message["role"] == original["role"]
        if message["role"] != "assistant":
            assert message == original  # system and user turns are kept
        else:
            prompt = codec.generation_prompt(history)
            expected = argmax_continuation(hf, prompt, codec.stop_ids, 40)
            stopped = expected[-1] in codec.stop_ids
            assert message["content"] == codec.decode(expected[:-1] if stopped else expected)
            assert out["regenerated"]["truncated"][turns] == (not stopped)
            turns += 1
        history.append(message)
    assert turns == 2 and out["messages"][2]["content"] != "this answer is replaced"


@pytest.mark.parametrize("method", ["autoregressive", "speculative"])
def test_rows_decoded_together_equal_rows_decoded_alone(tiny_model: MTPCModel, method: str) -> None:
    """16 turns at once (rows of one, two and three assistant turns, a row whose prompt
    leaves no room, a malformed row): every row equals the row regenerated alone."""
    codec = get_codec("tiny")
    rows: list[tuple[int, dict[str, Any]]] = []
    for i in range(20):
        turns = 1 + i % 3
        messages = []
        for t in range(turns):
            messages += [
                {"role": "user", "content": f"Question {i}.{t}: what is {i} + {t}?" * (1 + i % 4)},
                {"role": "assistant", "content": ""},
            ]
        rows.append((100 + i, {"id": f"r{i}", "messages": messages}))
    rows.append(
        (
            200,
            {
                "id": "long",
                "messages": [
                    {"role": "user", "content": "x" * 300},
                    {"role": "assistant", "content": "y"},
                ],
            },
        )
    )
    rows.append((201, {"id": "bad", "messages": [{"role": "user", "content": "no answer"}]}))
    settings = Settings(method=method, max_new_tokens=24)
    alone = [regenerate_row(tiny_model, codec, row, i, settings, 320) for i, row in rows]
    together = regenerate_rows(tiny_model, codec, rows, settings, 320, batch_size=16)
    assert together == alone
    assert [r.reason for r in together[-2:]] == ["prompt_too_long", "no_assistant_turn"]
    written = [r.row for r in together if r.row]
    assert len(written) >= 15 and {len(r["regenerated"]["new_tokens"]) for r in written} == {
        1,
        2,
        3,
    }


@pytest.mark.slow
def test_sampled_regeneration_has_the_targets_distribution() -> None:
    """Speculative sampling through regenerate_row, outcome = the turn up to its stop id."""
    V, L, N = 4, 3, 800
    hf = make_target(vocab=V, hidden=16, seed=1, context=64)
    with torch.no_grad():
        hf.lm_head.weight.mul_(8)  # a peaked, position-dependent target
    torch.manual_seed(2)
    model = MTPCModel.from_hf(hf, kind="btree", window=2, rank=2, head_init="random", init_std=0.5)
    codec = FourIdCodec()
    row = {"messages": [{"role": "user", "content": "abca"}, {"role": "assistant", "content": "c"}]}
    settings = Settings(method="speculative", greedy=False, max_new_tokens=L, seed=3)
    prompt = codec.generation_prompt(row["messages"][:1])
    full = exact_distribution(hf, prompt, L)  # (V^L,)
    import itertools

    def outcome(ids: Sequence[int]) -> tuple[int, ...]:
        cut = next((i for i, t in enumerate(ids) if t == 0), None)
        return tuple(ids if cut is None else ids[: cut + 1])

    probs: Counter[tuple[int, ...]] = Counter()
    for seq, p in zip(itertools.product(range(V), repeat=L), full.tolist(), strict=True):
        probs[outcome(seq)] += p
    counts: Counter[tuple[int, ...]] = Counter()
    for index in range(N):  # every row index draws from its own seed
        out = regenerate_row(model, codec, row, index, settings, 64).row
        assert out is not None
        ids = codec.encode(out["messages"][1]["content"])
        counts[tuple(ids) + (() if out["regenerated"]["truncated"][0] else (0,))] += 1
    keys = sorted(probs)
    assert set(counts) <= set(keys)
    pvalue = chi2_pvalue(
        torch.tensor([float(counts[k]) for k in keys]), torch.tensor([probs[k] for k in keys])
    )
    assert pvalue > 1e-3


def test_shard_indices_cover_every_row_once() -> None:
    for num_rows in (0, 1, 7, 24):
        for num_shards in (1, 2, 3, 5):
            got = sorted(
                i for s in range(num_shards) for i in shard_indices(num_rows, s, num_shards)
            )
            assert got == list(range(num_rows))


def test_shards_in_one_folder_hold_every_row_once_and_train_reads_them(tmp_path: Path) -> None:
    out = tmp_path / "regen"
    for shard in range(3):
        manifest = regenerate(
            compose_cfg(
                "data.num_rows=7", "max_new_tokens=12", f"shard={shard}", "num_shards=3",
                f"output_dir={out}",
            )
        )  # fmt: skip
        assert manifest["counts"]["written"] + manifest["counts"]["skipped_total"] == len(
            shard_indices(7, shard, 3)
        )
    assert sorted(rows_by_index(out)) == list(range(7))
    assert len(list(out.glob("shard-*-of-00003.jsonl"))) == 3
    source = load_source("synthetic", str(out))  # what data.path=<folder> reads
    assert sorted(r["regenerated"]["index"] for r in source) == list(range(7))
    both = load_source("synthetic", [str(out), str(out / "shard-00000-of-00003.jsonl")])
    assert len(list(both)) == 7 + 3  # data.path=[a,b]: a's rows, then b's
    # another sharding of the same folder would mix rows: refused
    with pytest.raises(RegenerateMismatchError, match="num_shards"):
        regenerate(compose_cfg("data.num_rows=7", "max_new_tokens=12", f"output_dir={out}"))


def test_greedy_runs_are_identical_and_changed_settings_are_refused(tmp_path: Path) -> None:
    args = ("data.num_rows=4", "max_new_tokens=24")
    regenerate(compose_cfg(*args, f"output_dir={tmp_path / 'a'}"))
    regenerate(compose_cfg(*args, f"output_dir={tmp_path / 'b'}"))
    a = (tmp_path / "a" / "shard-00000-of-00001.jsonl").read_bytes()
    assert a == (tmp_path / "b" / "shard-00000-of-00001.jsonl").read_bytes() and a.count(b"\n") == 4
    again = regenerate(compose_cfg(*args, f"output_dir={tmp_path / 'a'}"))  # resumes: nothing to do
    assert again["sessions"][-1]["rows"] == 0 and len(again["sessions"]) == 2
    with pytest.raises(RegenerateMismatchError, match="max_new_tokens"):
        regenerate(
            compose_cfg("data.num_rows=4", "max_new_tokens=25", f"output_dir={tmp_path / 'a'}")
        )
    with pytest.raises(RegenerateMismatchError, match="greedy"):
        regenerate(compose_cfg(*args, "greedy=false", f"output_dir={tmp_path / 'a'}"))
    assert (tmp_path / "a" / "shard-00000-of-00001.jsonl").read_bytes() == a  # nothing mixed in


def test_wrong_settings_fail_before_any_work() -> None:
    with pytest.raises(ConfigError, match="shard=2 is not allowed with num_shards=2"):
        regenerate(compose_cfg("shard=2", "num_shards=2"))
    with pytest.raises(ConfigError, match="temperature"):
        regenerate(compose_cfg("temperature=0"))
    with pytest.raises(ConfigError, match="draft="):
        regenerate(compose_cfg("draft=/no/such/draft"))
    with pytest.raises(ConfigError, match="drafting='map' is not allowed with greedy=false"):
        regenerate(compose_cfg("greedy=false", "drafting=map"))
    with pytest.raises(ConfigError, match="proposal='path' is not allowed with greedy=true"):
        regenerate(compose_cfg("proposal=path"))


def test_drafting_choices_reach_the_decoder(tiny_model: MTPCModel) -> None:
    """``drafting`` / ``proposal`` are what speculative decoding drafts with: a proposal
    greedy decoding cannot use is refused by the decoder itself."""
    from mtpc.decoding.settings import SettingsError

    codec = get_codec("tiny")
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]}
    greedy_map = Settings(method="speculative", max_new_tokens=8, drafting="map")
    assert regenerate_row(tiny_model, codec, row, 0, greedy_map, 1024).row is not None
    wrong = Settings(method="speculative", max_new_tokens=8, proposal="marginal")
    with pytest.raises(SettingsError, match="proposal='marginal' is not allowed with greedy"):
        regenerate_row(tiny_model, codec, row, 0, wrong, 1024)


def test_too_long_prompts_and_rows_without_an_assistant_turn_are_counted(
    tiny_model: MTPCModel,
) -> None:
    codec = get_codec("tiny")
    long = {
        "messages": [{"role": "user", "content": "x" * 1100}, {"role": "assistant", "content": "y"}]
    }
    assert regenerate_row(tiny_model, codec, long, 0, Settings(), 1024).reason == "prompt_too_long"
    none = {"messages": [{"role": "user", "content": "hi"}]}
    assert (
        regenerate_row(tiny_model, codec, none, 1, Settings(), 1024).reason == "no_assistant_turn"
    )


def _script(out: Path, *args: str) -> list[str]:
    return [
        sys.executable, str(ROOT / "scripts" / "regenerate.py"), "data.num_rows=6",
        "max_new_tokens=24", "greedy=false", "progress=false", f"output_dir={out}", *args,
    ]  # fmt: skip


@pytest.mark.slow
def test_batch_16_writes_the_rows_of_batch_1(tmp_path: Path) -> None:
    """The script at batch_size=16 (greedy) writes the rows file of batch_size=1, byte for
    byte."""
    one, many = tmp_path / "one", tmp_path / "many"
    for out, size in ((one, 1), (many, 16)):
        args = _script(out, "greedy=true", "data.num_rows=40", f"batch_size={size}")
        subprocess.run(args, check=True, env=ENV, capture_output=True, cwd=ROOT)
    rows = "shard-00000-of-00001.jsonl"
    assert (many / rows).read_bytes() == (one / rows).read_bytes()
    assert len((one / rows).read_bytes().splitlines()) == 40


@pytest.mark.slow
@needs_evabyte_code
def test_evabyte_at_batch_4_writes_the_rows_of_batch_1(tmp_path: Path) -> None:
    """EvaByte (a tiny checkpoint of its real code, EVA window 16) batches: sampled, the
    script at batch_size=4 writes the rows file of batch_size=1, byte for byte (it refused
    batch_size > 1 before its rows had their own EVA windows)."""
    path = evabyte_checkpoint(tmp_path / "ckpt")
    eva = ("model=evabyte", f"model.path={path}", "model.dtype=float32", "data.num_rows=8")
    one, many = tmp_path / "one", tmp_path / "many"
    for out, size in ((one, 1), (many, 4)):
        args = _script(out, *eva, f"batch_size={size}")
        subprocess.run(args, check=True, env=ENV, capture_output=True, cwd=ROOT)
    rows = "shard-00000-of-00001.jsonl"
    assert (many / rows).read_bytes() == (one / rows).read_bytes()
    assert len((one / rows).read_bytes().splitlines()) == 8


@pytest.mark.slow
@pytest.mark.parametrize("size", [1, 2])
def test_sigkill_then_rerun_gives_every_row_once_equal_to_an_uninterrupted_run(
    tmp_path: Path, size: int
) -> None:
    """Sampled, so a resumed row must also draw from its own seeds. At batch_size=2 rows are
    written in chunks of 8: killed after the first chunk, the rerun writes the rest once."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    count, first = (6, 2) if size == 1 else (20, 8)
    extra = (f"data.num_rows={count}", f"batch_size={size}")
    subprocess.run(_script(whole, *extra[:1]), check=True, env=ENV, capture_output=True, cwd=ROOT)
    proc = subprocess.Popen(_script(killed, *extra), env=ENV, cwd=ROOT, stderr=subprocess.DEVNULL)
    rows = killed / "shard-00000-of-00001.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if rows.is_file() and rows.read_bytes().count(b"\n") >= first:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    written = rows.read_bytes().count(b"\n")
    assert first <= written < count, "kill the run mid-way"
    with rows.open("ab") as f:  # a line the kill cut in half
        f.write(b'{"id":"synthetic-0-00000')
    done = subprocess.run(
        _script(killed, *extra), env=ENV, capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert f"{count} rows written" in done.stdout
    assert rows_by_index(killed) == rows_by_index(whole)
    assert sorted(rows_by_index(killed)) == list(range(count))
    manifest = json.loads((killed / "manifest-00000-of-00001.json").read_text())
    assert (
        manifest["counts"]["written"] == count
        and manifest["sessions"][-1]["resumed_after"] == written
    )
    refused = subprocess.run(
        _script(killed, *extra, "temperature=0.5"), env=ENV, capture_output=True, text=True,
        cwd=ROOT,
    )  # fmt: skip
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [  # one line, before the target loads
        f"error: {killed} holds rows of another regeneration (manifest-00000-of-00001.json); "
        "changed: settings.temperature: 1.0 -> 0.5. Use another output_dir, or the same "
        "settings to resume"
    ]


def test_compile_writes_the_rows_of_eager_decoding_with_and_without_a_draft(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model: MTPCModel
) -> None:
    """``compile=aot_eager`` (no C compiler needed) decodes on the static engine, writes the
    eager rows byte for byte and records the setting in its session: autoregressive, and
    speculative with ``draft=`` (the chain on the engine)."""
    import mtpc.decoding.static as static

    engines: list[str] = []
    decode_static = static.decode_static

    def spy(*a: Any, **k: Any) -> Any:
        results = decode_static(*a, **k)
        engines.extend(r.engine for r in results)
        return results

    monkeypatch.setattr(static, "decode_static", spy)
    args = ("data.num_rows=4", "max_new_tokens=24")
    regenerate(compose_cfg(*args, f"output_dir={tmp_path / 'eager'}"))
    assert not engines
    full = regenerate(compose_cfg(*args, "compile=aot_eager", f"output_dir={tmp_path / 'c'}"))
    assert engines and set(engines) == {"compiled"}
    rows = "shard-00000-of-00001.jsonl"
    assert (tmp_path / "c" / rows).read_bytes() == (tmp_path / "eager" / rows).read_bytes()
    assert full["sessions"][-1]["compile"] == "aot_eager"
    draft = tiny_model.save_pretrained(tmp_path / "draft")
    engines.clear()
    regenerate(compose_cfg(*args, f"draft={draft}", f"output_dir={tmp_path / 'de'}"))
    assert not engines
    regenerate(compose_cfg(*args, "compile=aot_eager", f"draft={draft}",
                           f"output_dir={tmp_path / 'dc'}"))  # fmt: skip
    assert engines and set(engines) == {"compiled"}
    assert (tmp_path / "dc" / rows).read_bytes() == (tmp_path / "de" / rows).read_bytes()
