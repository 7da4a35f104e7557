"""Shared pytest setup: offline hub, seeded RNGs, small thread pool."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import pytest
import torch

# Batch-1 decoding of tiny models is fastest on one thread, and CI has 2 shared cores.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    """Every test starts from the same RNG state, so failures reproduce."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch thread for the test, the previous count restored after it (a test or the code
    under test may change it). Batch-1 decoding of tiny models is fastest (and steadiest) on
    one thread; modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
