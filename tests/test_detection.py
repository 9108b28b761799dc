"""The detection-rate table in spec/README.md stays honest.

``python -m spec.detection --write`` measures it (ci + 20 default seeds per planted bug); here, cheaply:
every planted bug has a row, ci rejects every one (the table says so, and test_power re-checks it
live), and a sample of quiet bugs is rejected by independent ``default`` runs. The sample and the runs' seeds
are fixed by the test's name (not the date): a failure reproduces on any day, on any machine.
"""

from __future__ import annotations

import random
import re
import zlib

import pytest

from spec.detection import BEGIN, END, README, detects
from spec.planted import PLANTED

ROW = re.compile(r"^\| `([a-z0-9_]+)` \| [^|]* \| ([^|]+) \| (\d+)/(\d+) \|$")


def _table() -> dict[str, tuple[str, int, int]]:
    text = README.read_text()
    assert BEGIN in text and END in text, "spec/README.md lacks the detection table (python -m spec.detection --write)"
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    return {m.group(1): (m.group(2).strip(), int(m.group(3)), int(m.group(4)))
            for line in block.splitlines() if (m := ROW.match(line))}


def test_table_covers_every_planted_bug() -> None:
    rows = _table()
    assert sorted(rows) == sorted(PLANTED), (f"detection table out of date: missing {sorted(set(PLANTED) - set(rows))}, "
                                             f"stale {sorted(set(rows) - set(PLANTED))}")


def test_table_says_ci_rejects_every_bug_and_default_mostly() -> None:
    for name, (ci, hits, seeds) in _table().items():
        assert ci != "**no**", f"the table records that ci misses {name}"
        assert seeds >= 20, f"{name}: measured over {seeds} seeds, need >= 20"
    rows = _table().values()
    assert sum(h for _, h, _ in rows) >= 0.95 * sum(s for _, _, s in rows)


QUIET = sorted(name for name, bug in PLANTED.items() if bug.quiet)
TEST = "test_default_runs_reject_a_quiet_bug"
#: the sample and the seeds come from the test's name: the same every day (each run has no example database)
SAMPLE = random.Random(zlib.crc32(TEST.encode())).sample(QUIET, 3)


@pytest.mark.parametrize("name", SAMPLE)
def test_default_runs_reject_a_quiet_bug(name) -> None:
    base = zlib.crc32(f"{TEST}[{name}]".encode())
    hits = [detects(PLANTED[name], "default", seed=base + k) for k in range(4)]
    assert sum(h is not None for h in hits) >= 3, f"{name}: rejected by {hits} of 4 independent default runs"
