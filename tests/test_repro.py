"""The standalone reproducers (spec/repro/): for planted bugs across the invariant families, the reproducer the
suite writes for the failure exits 1 (got vs expected printed), and the same reproducer with impl's engine block
(the bug fixed) exits 0, in a process where ``spec`` cannot be imported.

Cheap by construction: each invariant runs a few examples without shrinking past the first failure's replay
(a planted bug fails on the pinned or first drawn cases), and the impl reproducers run in one subprocess.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spec.cases.structure import EngineCase
from spec.engines.impl.adapter import ImplEngine
from spec.invariants import CATALOGUE
from spec.invariants.core import Ctx
from spec.planted import planted_engine
from spec.repro import plan_for, run_reproducer, write_reproducer, write_reproducers
from spec.run.registry import load_engine
from spec.run.runner import run_invariant

ROOT = Path(__file__).resolve().parents[1]

#: (planted bug, the invariant whose failure is reproduced, mode): one per family the reproducers cover
BUGS = (
    ("loss_mask_attention", "INV-MASK-001", "padded"),  # mask
    ("double_temperature", "INV-TEMP-001", "packed"),  # values vs the reference, per-sample temperature
    ("labels_not_rolled", "INV-LABEL-001", "padded"),  # labels
    ("global_max_shift", "INV-LEAK-001", "padded"),  # NaN padding leaking into outputs
    ("sum_pi_squared_missing_padded", "INV-KEYS-002", "both"),  # run vs run (packed and padded)
    ("mutate_logits", "INV-MUT-002", "padded"),  # inputs left unchanged
    ("slice_without_shift", "INV-SLICE-002", "packed"),  # the response slice helper
    ("shard_roll", "INV-SP-001", "packed"),  # sequence parallelism: ranks in threads, vs sp=1 and the reference
    ("inplace_div_without_grad", "INV-MUT-002", "packed"),  # the autograd context: shows only without grad
    ("entropy_detached_with_grad", "INV-GRAD-001", "packed"),  # and one that shows only with grad
    ("bucket_positions_continue", "INV-PAD-001", "packed"),  # the hand-off alone: the packed tail padding
    ("fused_temperature_tensor", "INV-FUSED-001", "packed"),  # what a fused-kernel model is handed
    ("slice_through_float", "INV-DTYPE-001", "any"),  # the helpers on per-token tensors the file builds
    ("entropy_flag_defaults_true", "INV-FLAG-001", "packed"),  # a run without the flags vs the case's run
    ("pad_mode_unchecked", "INV-ERR-001", "any"),  # a rejection: the engine must raise, not return
    ("outputs_ignore_pad_mode", "INV-FLAG-004", "packed"),  # a refused setting, by prepare_model_outputs alone too
    ("chunk_size_or_none", "INV-SET-001", "packed"),  # an impossible engine setting
    ("mask_cached_by_shape", "INV-BATCH-003", "padded"),  # one engine object kept across two micro-batches
)

#: bugs the first five drawn cases (and the pinned ones) miss: a few more examples (derandomized under ci)
EXAMPLES = {"sum_pi_squared_missing_padded": 30, "inplace_div_without_grad": 30}

ENGINE_BEGIN, ENGINE_END = "# ---- engine under test (begin) ----", "# ---- engine under test (end) ----"

#: runs each file given on the command line with ``spec`` unimportable; prints "<exit code> <path>" per file
RUN_WITHOUT_SPEC = """
import runpy, sys
sys.modules["spec"] = None  # any import of the suite fails
for path in sys.argv[1:]:
    try:
        runpy.run_path(path, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    print("EXIT", code, path, flush=True)
"""


def _without_engine(source: str) -> str:
    head, rest = source.split(ENGINE_BEGIN)
    return head.split('"""', 2)[2] + rest.split(ENGINE_END)[1]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """For each bug: the planted engine's reproducer (run in process) and the impl twin (written only)."""
    folder = tmp_path_factory.mktemp("repro")
    made = []
    for bug, invariant, mode in BUGS:
        engine = load_engine(f"planted:{bug}")
        outcome = run_invariant(CATALOGUE[invariant], engine, mode, "cpu", profile="ci", shrink=False,
                                max_examples=EXAMPLES.get(bug, 5), database=None)
        assert outcome.status == "fail", (bug, outcome.status, outcome.error)
        (rep,) = write_reproducers([outcome], engine, folder / bug)
        twin, why = write_reproducer(folder / bug / f"{invariant}-{mode}-impl.py", invariant=invariant, mode=mode,
                                     engine=ImplEngine(), case=outcome.case)
        assert why is None
        made.append((bug, outcome, rep, twin))
    return made


def test_every_family_used_here_has_a_plan() -> None:
    for _, invariant, _ in BUGS:
        assert plan_for(invariant) is not None, invariant


def test_every_reproduction_record_names_checks_the_runtime_has() -> None:
    """An invariant's reproducer is declared where the invariant is (``repro=``, spec/invariants/reproduction.py),
    and each check its plan names is one the file's runtime runs (spec/repro/runtime.py, and on real ranks
    vendored/real_ranks.py): a misspelt name fails here, not in a user's reproducer."""
    from spec.invariants import CATALOGUE
    from spec.invariants.reproduction import LayerCheck, Plan
    from spec.repro import runtime
    from spec.repro.vendored import real_ranks

    known = set(runtime.CHECKS) | set(runtime.WITH_FRESH)
    plans = {inv: info.repro for inv, info in CATALOGUE.items() if isinstance(info.repro, Plan)}
    assert len(plans) >= 60, len(plans)
    for inv, plan in plans.items():
        allowed = known | set(real_ranks.RANK_CHECKS) if plan.real_ranks else known
        assert plan.checks and set(plan.checks) <= allowed, (inv, set(plan.checks) - allowed)
    layers = {inv: info.repro for inv, info in CATALOGUE.items() if isinstance(info.repro, LayerCheck)}
    assert all(inv.startswith("INV-MB-") and CATALOGUE[inv].functions for inv in layers), sorted(layers)
    assert sum(record.on == "engine" for record in layers.values()) == 1  # spec/repro/end_to_end.py writes one


def test_planted_reproducers_fail(written) -> None:
    for bug, outcome, rep, _ in written:
        assert rep.status == "reproduces", (bug, rep.status, rep.detail)
        code, printed = run_reproducer(rep.path)  # again, from the file on disk
        # got vs expected (or what is missing), or the invariant's own message: the file runs the invariant's check
        # (spec/truth/), the run-vs-run invariants' against the reference (KEYS-002: each run's keys)
        said = str(outcome.error).splitlines()[0].split("AssertionError: ", 1)[-1][:60]
        assert code == 1 and any(word in printed for word in ("expected", "missing", said)), \
            (bug, code, printed, outcome.error)
        # a failed check (``FAIL <ID> (<check>) on ...``), not an exception of the engine's or of the file's own
        assert re.search(r"^FAIL \S+ \(\w+\) on ", printed, re.M), (bug, printed)


def test_the_impl_twin_is_the_same_reproducer(written) -> None:
    """Only the engine block differs between a bug's reproducer and its impl twin."""
    for bug, _, rep, twin in written:
        assert _without_engine(rep.path.read_text()) == _without_engine(twin.read_text()), bug
        text = twin.read_text()
        assert "import impl" in text and not re.search(r"^\s*(import|from)\s+spec\b", text, re.M), bug


def test_impl_twins_pass_without_the_suite(written, tmp_path) -> None:
    twins = [str(twin) for *_, twin in written]
    # a user's engine given as module:attr is imported from its own module, not through the suite
    _, outcome, _, _ = written[1]
    user, why = write_reproducer(tmp_path / "user.py", invariant=outcome.invariant, mode=outcome.mode,
                                 engine=load_engine("tests.factory_engine:make_engine"), case=outcome.case)
    assert why is None and "tests.factory_engine" in user.read_text()
    twins.append(str(user))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-c", RUN_WITHOUT_SPEC, *twins], capture_output=True, text=True,
                          env=env, cwd=str(Path(twins[0]).parent), timeout=300)
    codes = {line.split()[2]: int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("EXIT")}
    assert set(codes) == set(twins), done.stdout + done.stderr
    assert all(code == 0 for code in codes.values()), done.stdout + done.stderr


_IMPORTS_SPEC = re.compile(r"(^|\\n)\s*(import|from)\s+spec\b", re.M)


def test_a_planted_engine_is_written_out_over_impl(written) -> None:
    """A planted engine whose bug is its engine class or a padding helper it hands out is written into its file (its
    module under a private name) over impl imported: the file imports impl, not the suite, and exits 1 with ``spec``
    unimportable (impl is rl-ioprep's, which its Needs names)."""
    names = {bug: rep.path for bug, _, rep, _ in written
             if re.search(r"^_written_spec_planted", rep.path.read_text(), re.M)}
    # an engine class (double_temperature, mask_cached_by_shape), a padding helper (slice_without_shift,
    # slice_through_float), a shard bug run in threads (shard_roll)
    assert {"double_temperature", "mask_cached_by_shape", "slice_without_shift", "slice_through_float",
            "shard_roll"} <= set(names), sorted(names)
    for bug, path in names.items():
        text = path.read_text()
        assert re.search(r"^import impl$", text, re.M) and not _IMPORTS_SPEC.search(text), bug
        assert "Needs: pip install rl-ioprep torch tensordict" in text, bug
    alone = [str(p) for p in names.values()]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-c", RUN_WITHOUT_SPEC, *alone], capture_output=True, text=True, env=env,
                          cwd=str(Path(alone[0]).parent), timeout=600)
    codes = {line.split()[2]: int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("EXIT")}
    assert set(codes) == set(alone) and all(c == 1 for c in codes.values()), done.stdout[-3000:] + done.stderr[-3000:]


def test_an_invariant_without_a_plan_says_so(tmp_path) -> None:
    from spec.cases.structure import EngineCase

    path, why = write_reproducer(tmp_path / "x.py", invariant="INV-NONE-999", mode="any", engine=ImplEngine(),
                                 case=EngineCase((1,), (1,)))
    assert why and "INV-NONE-999" in why
    code, printed = run_reproducer(path)
    assert code == 2 and printed.startswith("NOT STANDALONE")


def test_a_declared_lower_precision_is_the_files_tolerance_too(tmp_path) -> None:
    """An engine that declares log_probs computed from bf16-scaled logits (the planted bf16 fast path, verl's
    declaration) is compared at that precision by the suite and by its reproducer alike: at T = 1 its bug does not
    show and both pass (at float32's tolerance the file failed on the bf16 rounding); at T = 0.5 both fail, on
    log_probs, the key the suite reports."""
    engine = planted_engine("bf16_path_skips_temperature")
    info = CATALOGUE["INV-VAL-001"]
    for temperature, code in ((1.0, 0), (0.5, 1)):
        case = EngineCase((3, 2), (4, 3), vocab=64, temperature=temperature, logits_dtype="bfloat16", seed=5)
        try:
            info.check(Ctx(engine, case, "cpu", "packed"))
            suite = 0
        except AssertionError as exc:
            suite = 1
            assert "'log_probs'" in str(exc), exc
        path, why = write_reproducer(tmp_path / f"T{temperature}.py", invariant="INV-VAL-001", mode="packed",
                                     engine=engine, case=case)
        assert why is None
        assert "'precision': {'log_probs': ('float32', 'bfloat16')}" in path.read_text()
        got, printed = run_reproducer(path)
        assert (suite, got) == (code, code), (temperature, suite, printed)
        if code:
            assert "'log_probs' of sequence" in printed, printed
