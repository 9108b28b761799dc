"""The detection-rate table in spec/README.md stays honest.

``python -m spec.detection --write`` measures it (ci + 20 default seeds per planted bug); here, cheaply:
every planted bug has a row, ci rejects every one (the table says so, and test_power re-checks it
live), and a rotating sample of quiet bugs is rejected by independent ``default`` runs.
"""

from __future__ import annotations

import datetime
import random
import re

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
# a different sample every day, reproducible within the day
SAMPLE = random.Random(datetime.date.today().toordinal()).sample(QUIET, 3)


@pytest.mark.parametrize("name", SAMPLE)
def test_default_runs_reject_a_quiet_bug(name) -> None:
    hits = [detects(PLANTED[name], "default", seed=1000 + k) for k in range(4)]
    assert sum(h is not None for h in hits) >= 3, f"{name}: rejected by {hits} of 4 independent default runs"
