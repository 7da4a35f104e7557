"""Overhead of streaming per-prompt records (``records.jsonl``) during an evaluation.

    python scripts/bench_eval_records.py <draft dir> [--repeats 5] [eval.yaml overrides]

Runs the same evaluation (the CPU default unless overridden) ``repeats`` times in each of two
modes, alternating: ``streamed`` (every record serialised, appended and flushed as the prompt
finishes, as ``eval.py`` does) and ``in memory`` (``RecordStore.append`` keeps the record in
the list only and the file is written once at the end, as the evaluator did before records
were streamed). Each run gets a fresh folder; the first pair is a warm-up, not counted.
Prints the wall time of ``evaluate`` per mode and the cost of one append of a real record,
measured alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

from benchlib import markdown_header, markdown_row, timed

ROOT = Path(__file__).resolve().parents[1]
CLOSE: Any = None  # RecordStore.close, kept while it is patched
os.environ.setdefault("PROJECT_ROOT", str(ROOT))


def _in_memory(self: Any, record: dict[str, Any]) -> None:
    from mtpc.evaluation.records import record_key

    self.records.append(record)
    if record.get("type") == "prompt":
        self.done.add(record_key(record))


def _write_at_close(self: Any) -> None:
    from mtpc.evaluation.records import RECORDS, dumps

    file = self._lines[self.folder / RECORDS]  # the store's open records.jsonl
    file.write("".join(dumps(r, separators=(",", ":")) + "\n" for r in self.records))
    CLOSE(self)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("draft")
    parser.add_argument("--repeats", type=int, default=5)
    args, overrides = parser.parse_known_args()
    from hydra import compose, initialize_config_dir

    from mtpc.evaluation.records import RecordStore, read_records
    from mtpc.evaluation.run import evaluate

    global CLOSE
    CLOSE = RecordStore.close

    times: dict[str, list[float]] = {"streamed": [], "in memory": []}
    sample: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats + 1):
            for mode in times:
                out = Path(tmp) / f"{mode.replace(' ', '_')}-{repeat}"
                with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
                    cfg = compose(
                        "eval",
                        overrides=[f"draft={args.draft}", f"output_dir={out}", "plots=false",
                                   "progress=false", *overrides],
                    )  # fmt: skip
                if mode == "in memory":
                    with (
                        mock.patch.object(RecordStore, "append", _in_memory),
                        mock.patch.object(RecordStore, "close", _write_at_close),
                    ):
                        seconds, _ = timed(lambda cfg=cfg: evaluate(cfg))
                else:
                    seconds, _ = timed(lambda cfg=cfg: evaluate(cfg))
                if repeat:  # the first pair warms the caches up
                    times[mode].append(seconds)
                if mode == "streamed" and not sample:
                    sample = read_records(out)
        prompts = [r for r in sample if r["type"] == "prompt"]
        manifest: dict[str, Any] = {"sessions": [], "drafts": [], "settings": {}}
        store = RecordStore.open(Path(tmp) / "append", manifest)
        seconds, _ = timed(
            lambda: [store.append({**prompts[i % len(prompts)], "index": 10_000 + i})
                     for i in range(1000)]
        )  # fmt: skip
        append_us = seconds / 1000 * 1e6
        store.close()
    decode = statistics.mean(r["seconds"] for r in prompts)
    print(f"{len(prompts)} prompt records per evaluation; mean decoding time {decode * 1e3:.1f} ms")
    print(markdown_header("mode", "median s", "min s", "max s"))
    for mode, values in times.items():
        stats = (statistics.median(values), min(values), max(values))
        print(markdown_row([mode, *(f"{v:.2f}" for v in stats)]))
    print(
        f"one append (serialise + write + flush): {append_us:.0f} us = "
        f"{append_us / 1e4 / decode:.3f} % of a prompt's decoding"
    )


if __name__ == "__main__":
    main()
