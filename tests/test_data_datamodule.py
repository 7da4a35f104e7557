"""MTPCDataModule: batch format, resumable and sharded loading, prompt sets."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch

from mtpc.backbones.codecs import get_codec
from mtpc.data.datamodule import MTPCDataModule, ResumableDistributedSampler, build_datamodule
from mtpc.data.prompts import build_prompt_sets, is_english, split_at_last_user
from mtpc.data.windows import make_windows

WINDOW = 4


def rows(n: int) -> list[dict]:
    out = []
    for i in range(n):
        messages = [
            {"role": "user", "content": f"What is {i} plus {i}? " + "x" * (i % 13)},
            {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."},
        ]
        if i % 4 == 0:
            messages += [
                {"role": "user", "content": "And twice that?"},
                {"role": "assistant", "content": f"{4 * i}."},
            ]
        out.append({"id": f"r{i}", "messages": messages, "source": f"task/{i % 3}"})
    return out


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows(300)))
    return path


def make_dm(jsonl: Path, cache: Path, **kwargs: object) -> MTPCDataModule:
    args: dict = dict(
        source="local",
        path=str(jsonl),
        codec="tiny",
        seq_len=160,
        window=WINDOW,
        batch_size=4,
        seed=0,
        cache_dir=str(cache),
        validation_fraction=0.05,
    )
    args.update(kwargs)
    return build_datamodule(**args)


def test_batch_format(jsonl: Path, tmp_path: Path) -> None:
    dm = make_dm(jsonl, tmp_path)
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    b, length, n = 4, 160, WINDOW
    shapes = {
        "input_ids": (b, length),
        "position_ids": (b, length),
        "document_ids": (b, length),
        "attention_mask": (b, length),
        "loss_mask": (b, length),
        "source_ids": (b, length),
        "targets": (b, length, n),
        "target_mask": (b, length, n),
        "window_mask": (b, length, n),
        "valid_counts": (b, n),
        "index": (b,),
    }
    assert {k: tuple(v.shape) for k, v in batch.items()} == shapes
    assert batch["targets"].dtype == torch.int64 and batch["target_mask"].dtype == torch.bool
    assert batch["valid_counts"].dtype == torch.float32
    targets, mask, in_doc = make_windows(
        batch["input_ids"], batch["document_ids"], batch["loss_mask"], n, dm.codec.pad_id
    )
    assert torch.equal(targets, batch["targets"]) and torch.equal(mask, batch["target_mask"])
    assert torch.equal(in_doc, batch["window_mask"])
    assert torch.equal(batch["valid_counts"], mask.sum(1).float())
    # every loss byte decodes to assistant text or an end-of-turn id
    codec = get_codec("tiny")
    text = codec.decode(batch["input_ids"][batch["loss_mask"]].tolist())
    assert "plus" in text and "What is" not in text
    assert batch["source_ids"].max() < len(dm.source_names) == 3
    # the train split holds every document once over the packed sequences
    plan = dm.datasets["train"].plan
    assert sorted(plan.seg_doc.tolist()) == list(range(len(dm.data.splits["train"])))


def test_resume_mid_epoch_yields_the_same_next_batch(jsonl: Path, tmp_path: Path) -> None:
    dm = make_dm(jsonl, tmp_path)
    loader = dm.train_dataloader()
    loader.sampler.set_epoch(1)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    expected = [next(it)["index"] for _ in range(2)]
    assert state["epoch"] == 1 and state["batches"] == 3

    fresh = make_dm(jsonl, tmp_path).train_dataloader()  # a new process: cache hit, new loader
    fresh.load_state_dict(state)
    got = [b["index"] for b, _ in zip(fresh, range(2), strict=False)]
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    # the epoch after the resumed one starts from its first batch again
    fresh.sampler.set_epoch(2)
    full = [b["index"] for b in fresh]
    assert len(full) == len(fresh) and sum(len(i) for i in full) == len(dm.datasets["train"])


class _Recorder(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[list[int]] = []

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.seen.append(batch["index"].tolist())
        return (self.weight * batch["valid_counts"].sum()).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _trainer(root: Path, **kwargs: object) -> L.Trainer:
    return L.Trainer(
        default_root_dir=root,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_epochs=2,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        **kwargs,
    )


def test_lightning_restores_the_data_position_from_a_checkpoint(
    jsonl: Path, tmp_path: Path
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    every = L.pytorch.callbacks.ModelCheckpoint(
        ckpt_dir, every_n_train_steps=5, save_top_k=-1, filename="{step}"
    )
    full = _Recorder()
    _trainer(tmp_path, callbacks=[every]).fit(
        full, datamodule=make_dm(jsonl, tmp_path, batch_size=8)
    )
    steps_per_epoch = len(full.seen) // 2
    assert steps_per_epoch > 5
    for step in (5, steps_per_epoch + 5):  # mid-epoch 0 and mid-epoch 1
        resumed = _Recorder()
        _trainer(tmp_path).fit(
            resumed,
            datamodule=make_dm(jsonl, tmp_path, batch_size=8),
            ckpt_path=ckpt_dir / f"step={step}.ckpt",
        )
        assert resumed.seen == full.seen[step:]


@pytest.mark.parametrize("n", [40, 41])
@pytest.mark.parametrize("drop_last", [False, True])
def test_sharding_over_two_ranks(n: int, drop_last: bool) -> None:
    data = list(range(n))
    shards = [
        list(ResumableDistributedSampler(data, 2, rank, seed=5, drop_last=drop_last))
        for rank in (0, 1)
    ]
    assert len(shards[0]) == len(shards[1])
    seen = shards[0] + shards[1]
    if n % 2 == 0:
        assert sorted(seen) == data  # every example exactly once
    elif drop_last:
        assert len(set(seen)) == len(seen) == n - 1
    else:
        assert set(seen) == set(data) and len(seen) == n + 1  # one wrap-around repeat
    assert not set(shards[0]) & set(shards[1]) or (n % 2 and not drop_last)


def test_datamodule_shards_train_data(jsonl: Path, tmp_path: Path) -> None:
    seen = []
    for rank in (0, 1):
        dm = make_dm(jsonl, tmp_path, num_workers=0)
        dm.num_replicas, dm.rank = 2, rank
        seen.append([i for b in dm.train_dataloader() for i in b["index"].tolist()])
    total = len(dm.datasets["train"])
    assert len(seen[0]) == len(seen[1]) == (total + 1) // 2
    assert set(seen[0]) | set(seen[1]) == set(range(total))


def test_prompt_sets_are_deterministic_and_cut_at_the_last_user_turn(
    jsonl: Path, tmp_path: Path
) -> None:
    dm = make_dm(jsonl, tmp_path, validation_fraction=0.2)
    sets = dm.prompt_sets(num_prompts=10)
    again = make_dm(jsonl, tmp_path, validation_fraction=0.2).prompt_sets(num_prompts=10)
    assert [[p.id for p in s] for s in sets] == [[p.id for p in s] for s in again]
    assert [len(s) for s in sets] == [10, 10, 10]
    ids = [p.id for s in sets for p in s]
    assert len(set(ids)) == 30  # disjoint while the pool allows
    val_ids = {r["id"] for r in dm.data.val_rows()}
    assert set(ids) <= val_ids
    codec = get_codec("tiny")
    for prompt in sets[0]:
        assert prompt.messages[-1]["role"] == "user"
        assert prompt.prompt_ids == codec.generation_prompt(prompt.messages)
        assert prompt.reference.endswith(".")


def test_prompt_cut_and_english_filter() -> None:
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    prompt, reference = split_at_last_user(messages)
    assert prompt == messages[:4] and reference == "d"
    assert split_at_last_user(messages[:4]) is None
    assert is_english("What is the capital of France? Please explain it to me in detail.", "Paris.")
    assert not is_english("法国的首都是哪里？", "巴黎")
    assert not is_english(
        "¿Cuál es la capital de Francia? Explícamelo con detalle, por favor, gracias amigo.",
        "París",
    )
    assert is_english("Write a function that sorts a list.", "def f(x):\n    return sorted(x)")
    rows_ = [
        {
            "id": "zh",
            "messages": [
                {"role": "user", "content": "你好"},
                {"role": "assistant", "content": "你好"},
            ],
        }
    ]
    assert build_prompt_sets(rows_, get_codec("tiny"), num_prompts=1) == [[], [], []]
    assert (
        len(build_prompt_sets(rows_, get_codec("tiny"), num_prompts=1, english_only=False)[0]) == 1
    )


def test_pack_documents_false_gives_rows_of_one_document(jsonl: Path, tmp_path: Path) -> None:
    packed = make_dm(jsonl, tmp_path, num_workers=0)
    single = make_dm(jsonl, tmp_path, num_workers=0, pack_documents=False)
    for dm in (packed, single):
        dm.setup("fit")
    rows = [single.datasets["train"][k] for k in range(len(single.datasets["train"]))]
    assert all(int(r["document_ids"].max()) == 0 for r in rows)  # never a second document
    assert any(int(packed.datasets["train"][k]["document_ids"].max()) > 0
               for k in range(len(packed.datasets["train"])))  # fmt: skip
    assert len(single.datasets["train"]) > len(packed.datasets["train"])
    assert sum(int(r["attention_mask"].sum()) for r in rows) == sum(
        int(packed.datasets["train"][k]["attention_mask"].sum())
        for k in range(len(packed.datasets["train"]))
    )  # the same documents, only spread over more rows


def test_rows_of_one_document_are_trimmed_per_batch_without_changing_the_loss(
    jsonl: Path, tmp_path: Path
) -> None:
    """pack_documents=False: a batch is as long as its longest document; the loss is the same."""
    from torch.utils.data import default_collate

    from mtpc.model import MTPCModel
    from mtpc.training.module import MTPCLightningModule

    dm = make_dm(jsonl, tmp_path, num_workers=0, pack_documents=False, shuffle=False)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    full = default_collate([dm.datasets["train"][int(k)] for k in batch["index"]])
    length = int(full["attention_mask"].sum(1).max())
    assert batch["input_ids"].shape[1] == length < full["input_ids"].shape[1] == dm.seq_len
    assert (
        batch["targets"].shape[:2]
        == batch["target_mask"].shape[:2]
        == (len(batch["index"]), length)
    )
    module = MTPCLightningModule(MTPCModel.from_config("tiny", kind="cp", window=4, rank=2))
    with torch.no_grad():
        trimmed_loss = module._objective(batch)[0].loss
        full_loss = module._objective(full)[0].loss
    torch.testing.assert_close(trimmed_loss, full_loss)  # only padding was cut
