"""``MTPCDataModule``: chat rows -> packed byte sequences with window targets, for Lightning.

The batch format (keys, shapes, dtypes) is docs/DATA.md, "Batch format"; resuming and
sharding, "Resuming and sharding". ``valid_counts`` may be 0 for a row (a piece of a long
document cut inside a user turn), so a loss must clamp the divisor (``mtpc.training.loss``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler, default_collate

from mtpc.backbones.codecs import get_codec
from mtpc.data.cache import PreparedData, ensure_prepared, load_prepared
from mtpc.data.packing import PackPlan, build_sequence
from mtpc.data.preprocess import DEFAULT_MAX_BYTES, DEFAULT_VALIDATION_FRACTION
from mtpc.data.prompts import PROMPT_SET_SEEDS, EvalPrompt, build_prompt_sets
from mtpc.data.rows import default_cache_dir
from mtpc.data.sources import TULU3_DATASET, RowSource, load_source
from mtpc.data.windows import make_windows, valid_counts

logger = logging.getLogger(__name__)


class PackedDataset(Dataset[dict[str, Tensor]]):
    """The packed sequences of one split; item k is packed sequence k as a dict of tensors.
    Picklable without copying the corpus (workers reopen the memory-mapped cache)."""

    def __init__(
        self,
        data: PreparedData,
        split: str,
        seq_len: int,
        window: int,
        pad_id: int,
        pack: bool = True,
    ) -> None:
        self.folder = data.folder
        self.window = window
        self.pad_id = pad_id
        self.plan: PackPlan = data.pack_plan(split, seq_len, pack)
        docs = data.splits[split]
        self.doc_offsets = np.asarray(data.offsets[docs], dtype=np.int64)  # (D,)
        self.doc_sources = np.asarray(data.doc_source[docs], dtype=np.int64)  # (D,)
        self._data: PreparedData | None = data

    def __len__(self) -> int:
        return self.plan.num_sequences

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_data": None}

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        if self._data is None:  # a worker: the folder was verified by setup()
            self._data = load_prepared(self.folder, verify=False)
        seq = build_sequence(
            self.plan,
            int(index),
            self._data.ids,
            self._data.assistant,
            self.doc_offsets,
            self.doc_sources,
            self.pad_id,
        )
        item = {k: torch.from_numpy(v) for k, v in seq.items()}  # each (L,)
        # a batch of one: (1, L) each in, (1, L, n) each out
        ids, docs, loss = (item[k][None] for k in ("input_ids", "document_ids", "loss_mask"))
        targets, target_mask, window_mask = make_windows(ids, docs, loss, self.window, self.pad_id)
        item["attention_mask"] = item["document_ids"] >= 0
        item["targets"] = targets[0]  # (L, n)
        item["target_mask"] = target_mask[0]  # (L, n)
        item["window_mask"] = window_mask[0]  # (L, n)
        item["valid_counts"] = valid_counts(target_mask)[0]  # (n,)
        item["index"] = torch.tensor(int(index), dtype=torch.int64)
        return item


class ResumableDistributedSampler(DistributedSampler):
    """A ``DistributedSampler`` that can start mid-epoch: every rank draws the epoch's seeded
    permutation (seed + epoch), padded by wrap-around (or cut, with ``drop_last``) to a multiple
    of W = ``num_replicas``; rank r takes positions r, r + W, ... after the first ``start``."""

    start = 0  # global positions of this epoch's permutation consumed (ResumableDataLoader's)

    def __iter__(self) -> Iterator[int]:
        # a generator: the permutation is drawn at the first next(), after set_epoch
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(n, generator=g).tolist()
        else:
            indices = list(range(n))
        if not self.drop_last:  # pad by wrap-around
            while len(indices) < self.total_size:
                indices += indices[: self.total_size - len(indices)]
        # the epoch's permutation over all ranks, cut to total_size
        yield from indices[: self.total_size][self.start :][self.rank :: self.num_replicas]


def collate_trimmed(items: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Default collation, then the padding columns after the batch's longest row cut off (one
    document per row: padding is a suffix of each row, so (B, L, ...) tensors keep a prefix)."""
    batch = default_collate(items)
    full = batch["input_ids"].shape[1]
    length = int(batch["attention_mask"].sum(dim=1).max())
    if length >= full:
        return batch
    return {
        key: value[:, :length] if value.dim() >= 2 and value.shape[1] == full else value
        for key, value in batch.items()
    }


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` over a ``ResumableDistributedSampler`` that remembers its position:
    ``state_dict()`` is ``{epoch, batches}`` plus the settings checked on load (Lightning keeps
    it under ``loops.fit_loop.state_dict.combined_loader``); after ``load_state_dict`` the next
    ``iter()`` continues with batch ``batches`` of ``epoch``. Exact for the same batch and world
    size; another world size resumes at the same global position."""

    sampler: ResumableDistributedSampler
    _epoch = 0  # the epoch whose batches are counted (a new sampler's: 0)
    _batches = 0
    _resume = False

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        sampler = self.sampler
        if not (self._resume and sampler.epoch == self._epoch):
            sampler.start = 0
            self._epoch, self._batches = sampler.epoch, 0
        self._resume = False
        return self._counted(super().__iter__())

    def _counted(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            self._batches += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self._epoch,
            "batches": self._batches,
            "batch_size": self.batch_size,
            "num_replicas": self.sampler.num_replicas,
            "dataset_size": len(self.sampler.dataset),  # type: ignore[arg-type]
            "seed": self.sampler.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        size = len(self.sampler.dataset)  # type: ignore[arg-type]
        if state["dataset_size"] != size or state["seed"] != self.sampler.seed:
            raise ValueError(
                f"dataloader state is for {state['dataset_size']} sequences with seed {state['seed']}, "
                f"this loader has {size} with seed {self.sampler.seed}: the data or its settings changed"
            )
        if (
            state["batch_size"] != self.batch_size
            or state["num_replicas"] != self.sampler.num_replicas
        ):
            logger.warning(
                "resuming data with batch size %s x %s ranks, saved with %s x %s: position is approximate",
                self.batch_size,
                self.sampler.num_replicas,
                state["batch_size"],
                state["num_replicas"],
            )
        consumed = int(state["batches"]) * int(state["batch_size"]) * int(state["num_replicas"])
        self.sampler.set_epoch(int(state["epoch"]))
        self.sampler.start = min(consumed, self.sampler.total_size)
        self._epoch, self._batches, self._resume = int(state["epoch"]), int(state["batches"]), True


class MTPCDataModule(L.LightningDataModule):
    """Tülu 3 / local / synthetic / Python-code chat data as packed byte sequences.

    ``prepare_data`` (local rank 0) tokenises into the cache; ``setup`` (every rank) reads
    it back and builds the packing plans. Without Lightning: ``setup()``, then
    ``train_dataloader()``. Flat arguments (docs/DATA.md); ``pack_documents=False`` puts one
    document in each sequence, for targets whose attention crosses packed documents (EvaByte).
    """

    def __init__(
        self,
        source: str = "synthetic",
        path: str | Sequence[str] | None = None,
        codec: str = "tiny",
        seq_len: int = 8192,
        window: int = 8,
        batch_size: int = 1,
        seed: int = 0,
        num_workers: int = 0,
        cache_dir: str | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
        num_rows: int | None = None,
        streaming: bool = False,
        revision: str | None = None,
        hf_name: str = TULU3_DATASET,
        val_batch_size: int | None = None,
        shuffle: bool = True,
        drop_last: bool = False,
        pin_memory: bool = False,
        num_replicas: int | None = None,
        rank: int | None = None,
        pack_documents: bool = True,
    ) -> None:
        super().__init__()
        if seq_len < 2 or window < 1 or batch_size < 1:
            raise ValueError(
                f"need seq_len >= 2, window >= 1, batch_size >= 1; got {seq_len}, {window}, {batch_size}"
            )
        self._open_source = partial(
            load_source,
            source,
            path,
            num_rows=num_rows,
            seed=seed,
            streaming=streaming,
            revision=revision,
            hf_name=hf_name,
            validation_fraction=validation_fraction,
        )
        self._prepare = partial(
            ensure_prepared,
            codec=codec,
            cache_dir=default_cache_dir() if cache_dir is None else Path(cache_dir),
            max_bytes=max_bytes,
            seed=seed,
            validation_fraction=validation_fraction,
        )  # of the row source
        self.codec = get_codec(codec)
        self.seq_len = seq_len
        self.window = window
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size or batch_size
        self._train_sampler = partial(
            ResumableDistributedSampler, shuffle=shuffle, seed=seed, drop_last=drop_last
        )  # of the train split's dataset, world size and rank
        # both loaders' workers and collation; one document per row: batches cut to their
        # longest row (:func:`collate_trimmed`)
        self.loader_options: dict[str, Any] = {"num_workers": num_workers, "pin_memory": pin_memory}
        if not pack_documents:
            self.loader_options["collate_fn"] = collate_trimmed
        self.num_replicas = num_replicas
        self.rank = rank
        self.pack_documents = pack_documents
        self.data: PreparedData | None = None
        self.datasets: dict[str, PackedDataset] = {}
        self._row_source: RowSource | None = None

    # -- preparation ------------------------------------------------------------------

    def row_source(self) -> RowSource:
        """The raw rows (opened once)."""
        if self._row_source is None:
            self._row_source = self._open_source()
        return self._row_source

    def prepare_data(self) -> None:
        data = self._ensure_prepared()
        for split in ("train", "val"):
            data.pack_plan(split, self.seq_len, self.pack_documents)

    def _ensure_prepared(self) -> PreparedData:
        """The prepared data, checked against its hashes (rebuilt once if corrupt)."""
        return self._prepare(self.row_source())

    def setup(self, stage: str | None = None) -> None:
        if self.data is not None:
            return
        self.data = self._ensure_prepared()
        for split in ("train", "val"):
            self.datasets[split] = PackedDataset(
                self.data, split, self.seq_len, self.window, self.codec.pad_id, self.pack_documents
            )
        summary = self.data.summary
        logger.info(
            "data %s: %d train / %d val documents -> %d / %d packed sequences of %d; dropped %s",
            summary["dataset"],
            summary["train_docs"],
            summary["val_docs"],
            len(self.datasets["train"]),
            len(self.datasets["val"]),
            self.seq_len,
            {k: v for k, v in summary["dropped"].items() if v},
        )
        if summary.get("row_limit") is not None:
            logger.warning(
                "data %s: only the first %d rows are used (data.num_rows=%d; null: every row)",
                summary["dataset"],
                summary["row_limit"],
                summary["row_limit"],
            )

    @property
    def source_names(self) -> list[str]:
        """Names behind ``batch["source_ids"]``."""
        return self._prepared().source_names

    @property
    def summary(self) -> dict[str, Any]:
        """Rows seen / used / dropped by reason (the cache's ``summary.json``)."""
        return self._prepared().summary

    # -- loaders ----------------------------------------------------------------------

    def _world(self) -> tuple[int, int]:
        if self.num_replicas is not None:
            return self.num_replicas, self.rank or 0
        trainer = getattr(self, "trainer", None)
        if trainer is not None:
            return trainer.world_size, trainer.global_rank
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_world_size(), torch.distributed.get_rank()
        return 1, 0

    def train_dataloader(self) -> ResumableDataLoader:
        self.setup()
        dataset = self.datasets["train"]
        return ResumableDataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=self._train_sampler(dataset, *self._world()),
            persistent_workers=self.loader_options["num_workers"] > 0,
            **self.loader_options,
        )

    def val_dataloader(self) -> DataLoader:
        self.setup()
        dataset = self.datasets["val"]
        world, rank = self._world()
        sampler: DistributedSampler | None = None
        if world > 1:
            sampler = DistributedSampler(dataset, world, rank, shuffle=False)
        return DataLoader(
            dataset, batch_size=self.val_batch_size, sampler=sampler, **self.loader_options
        )

    # -- evaluation prompts -----------------------------------------------------------

    def prompt_sets(
        self,
        num_prompts: int = 250,
        seeds: Sequence[int] = PROMPT_SET_SEEDS,
        english_only: bool = True,
        max_prompt_length: int | None = None,
        sources: Sequence[str] | None = None,
    ) -> list[list[EvalPrompt]]:
        """Evaluation prompt sets from the validation split (``mtpc.data.prompts``)."""
        rows = self._prepared().val_rows()
        return build_prompt_sets(
            rows, self.codec, num_prompts, seeds, english_only, max_prompt_length, sources
        )

    def _prepared(self) -> PreparedData:
        self.setup()
        assert self.data is not None
        return self.data


# The Hydra ``_target_`` of ``configs/data/*.yaml``: the class itself takes flat arguments.
build_datamodule = MTPCDataModule
