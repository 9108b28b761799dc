"""verl conformance: the whole catalogue against the installed verl (skipped without verl).

* A verl whose padded attention mask covers the full sequences (0.9.1) must pass every
  invariant that applies to it; its documented known failures aside.
* A verl that builds the padded mask from the response-only ``loss_mask`` (0.7.1, verl
  issue #6278) must fail, and exactly on "the mask failure": the invariants of
  ``spec.engines.verl.records.MASK_INVARIANTS`` that apply to it (run, not skipped, not a known
  failure), each in padded mode only. The same instances pass once only the mask is
  replaced by the full-length one (a counterfactual engine below; verl is not patched).

Run by the CI steps ``verl091`` and ``verl071`` (``.ci/steps.sh``; ``tox -e verl091`` / ``tox -e verl071`` run them). The catalogue
run is ``python -m spec verify --engine verl --profile ci`` in a subprocess, or the JSON
report such a run already wrote (``VERL_CONFORMANCE_REPORT``, set by tox/CI right after
their own verify step, so the catalogue is not run twice).

Environment: ``VERL_EXPECT_VERSION`` (e.g. ``0.9.1``) and ``VERL_EXPECT_MASK_BUG`` (``0``/``1``)
pin what tox meant to install; unset, those checks skip.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="verl is not installed: run `tox -e verl091` or `tox -e verl071`")

from spec.cases.structure import EngineCase  # noqa: E402
from spec.run.registry import load_engine  # noqa: E402
from spec.invariants import CATALOGUE  # noqa: E402
from spec.cases.materialize import materialize  # noqa: E402
from spec.run.runner import run_invariant  # noqa: E402
from spec.engines.verl.adapter import VerlEngine  # noqa: E402
from spec.engines.verl.records import MASK_INVARIANTS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "spec" / "engines" / "verl" / "README.md"
PADDED_MODES = ("padded", "both")
#: the releases CI knows, and whether they have the loss-mask attention bug
PINNED = {"0.7.1": True, "0.9.1": False}


# -- the engine and the catalogue run -----------------------------------------------------------

@pytest.fixture(scope="module")
def engine() -> VerlEngine:
    eng = load_engine("verl")
    assert isinstance(eng, VerlEngine)
    return eng


def padded_mask_rows(engine: VerlEngine) -> tuple[EngineCase, list[int]]:
    """verl's padded attention mask for the seeds' worked example: the ones per row."""
    case = EngineCase(prompt_lens=(3, 2), response_lens=(2, 1), vocab=8, use_remove_padding=False)
    model_inputs, _ = engine.make().prepare_model_inputs(materialize(case))
    return case, [int(n) for n in model_inputs["attention_mask"].sum(1).tolist()]


@pytest.fixture(scope="module")
def mask_bug(engine: VerlEngine) -> bool:
    """True when verl's padded mask has r_i ones per row (#6278), False when it has n_i."""
    case, rows = padded_mask_rows(engine)
    assert rows in (list(case.seq_lens), list(case.response_lens)), (
        f"verl's padded attention mask has {rows} ones per row: neither the sequence lengths {case.seq_lens} "
        f"nor the response lengths {case.response_lens}")
    return rows == list(case.response_lens)


@pytest.fixture(scope="module")
def verify_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The JSON report of ``python -m spec verify --engine verl --profile ci`` and its exit code."""
    given = os.environ.get("VERL_CONFORMANCE_REPORT")
    if given and Path(given).is_file():
        report = json.loads(Path(given).read_text())
        report["returncode"] = None  # the caller's verify step checked it
    else:
        out = tmp_path_factory.mktemp("verl-verify")
        run = subprocess.run([sys.executable, "-m", "spec", "verify", "--engine", "verl", "--profile", "ci",
                              "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=3600)
        path = out / "verify-verl.json"
        assert path.is_file(), f"verify wrote no report (exit {run.returncode}):\n{run.stdout}\n{run.stderr}"
        report = json.loads(path.read_text())
        report["returncode"] = run.returncode
        report["stdout"] = run.stdout
    assert report["engine"] == "verl" and report["profile"] == "ci", (report["engine"], report["profile"])
    return report


def verdict_rows(outcomes: list[dict]) -> list[dict]:
    """The outcomes that make the verdict: layout-profile ones are informational. Known failures are
    applied per case by spec.run.runner (a record excuses only its cases and its failure)."""
    return [o for o in outcomes if not o.get("layout")]


def describe(outcomes: list[dict]) -> str:
    return "\n".join(f"  {o['invariant']} [{o['mode']}] {o['status']}: {o.get('counterexample')} -> "
                     f"{o.get('error') or o.get('reason')}" for o in outcomes)


def expected_mask_failures(outcomes: list[dict]) -> set[str]:
    """The mask invariants that apply: a padded instance ran and is not a known failure."""
    return {o["invariant"] for o in outcomes
            if o["invariant"] in MASK_INVARIANTS and o["mode"] in PADDED_MODES and o["status"] in ("pass", "fail")}


# -- environment ----------------------------------------------------------------------------------

def test_installed_versions_are_the_pinned_ones(engine: VerlEngine, mask_bug: bool) -> None:
    import tensordict
    import torch

    want = os.environ.get("VERL_EXPECT_VERSION")
    if want:
        assert engine.caps.version == want, f"verl {engine.caps.version} installed, {want} expected (`tox -r`?)"
    pins = (ROOT / "constraints-torch.txt").read_text()
    pinned = re.search(r"^torch==(\S+)", pins, re.M)
    if pinned:
        assert torch.__version__.split("+")[0] == pinned.group(1), (
            f"torch {torch.__version__} is installed, constraints-torch.txt pins {pinned.group(1)}")
    expect_bug = os.environ.get("VERL_EXPECT_MASK_BUG")
    if expect_bug is not None:
        assert mask_bug == (expect_bug == "1"), f"verl {engine.caps.version}: mask bug {mask_bug}, expected {expect_bug}"
    if engine.caps.version in PINNED:
        assert mask_bug == PINNED[engine.caps.version]
    print(f"verl {engine.caps.version}, torch {torch.__version__}, tensordict {tensordict.__version__}, "
          f"capabilities {engine.caps}")


def _all_records():
    from spec.engines.verl.records import KNOWN_BUGS

    return [r for records in KNOWN_BUGS.values() for r in records]


def test_known_failures_are_documented(engine: VerlEngine) -> None:
    doc = DOC.read_text()
    for record in [*engine.known_failures, *_all_records()]:
        assert record.invariant in CATALOGUE, f"known failure {record.key} names no invariant of the catalogue"
        assert f"`{record.key}`" in doc, f"known failure {record.key} of verl is not in {DOC.name}"
        assert record.when.text and record.matches, f"{record.key}: a record names its condition and its failure"
    assert MASK_INVARIANTS <= set(CATALOGUE), sorted(MASK_INVARIANTS - set(CATALOGUE))
    # the mask failure itself is never excused
    assert not {"INV-MASK-001", "INV-MASK-003"} & {r.invariant for r in [*engine.known_failures, *_all_records()]}


def test_catalogue_run_reports_known_hits(engine: VerlEngine, verify_run: dict) -> None:
    """Every certain record fired wherever an example met its condition: none passed under it (a data-dependent
    one, ``certain=False``, may have no hit on a run). A certain record whose condition no example of this run met
    (no hit, none passed under it) is unexercised by this run's draws, not stale: the pinned examples shift the
    derandomized stream, so which rare conditions a 100-example run meets moves with them; most certain records
    still fire. An excused invariant still ran all its examples."""
    certain, fired = 0, 0
    for o in verify_run["outcomes"]:
        for record in o.get("known", []):
            assert o["status"] != "xpass", (o["invariant"], record)
            if record.get("certain", True):
                certain, fired = certain + 1, fired + (record["hits"] > 0)
                assert record["hits"] > 0 or record.get("passed_under", 0) == 0, (o["invariant"], record)
        if o["status"] == "xfail":
            # an invariant drawing a share of the profile's examples (the micro-batch layer's: example_share) ran them all
            share = getattr(CATALOGUE[o["invariant"]], "example_share", None) or 1.0
            assert o["known_hits"] >= 1 and o["examples"] >= int(100 * share), (o["invariant"], o["examples"])
    assert fired >= max(1, certain * 3 // 4), f"only {fired} of {certain} certain records fired on this run"


# -- the run --------------------------------------------------------------------------------------

def test_catalogue_run(engine: VerlEngine, mask_bug: bool, verify_run: dict) -> None:
    outcomes = verdict_rows(verify_run["outcomes"])
    assert len(verify_run["outcomes"]) == sum(len(info.modes) for info in CATALOGUE.values()), "the run missed invariants"
    stale = [o for o in outcomes if o["status"] in ("xpass", "error")]
    assert not stale, f"stale known failures or suite errors on verl {engine.caps.version} (update KNOWN_BUGS):\n{describe(stale)}"
    failed = [o for o in outcomes if o["status"] == "fail"]
    rc = verify_run["returncode"]
    if not mask_bug:
        assert not failed, f"verl {engine.caps.version} fails invariants:\n{describe(failed)}"
        assert rc in (None, 0), verify_run.get("stdout")
        return
    # the mask failure: the run fails, on exactly the mask invariants that apply, in padded mode only
    assert rc in (None, 1), f"verify exited {rc} on verl {engine.caps.version}, which has the mask bug"
    assert failed, f"verl {engine.caps.version} has the loss-mask attention bug but the run passed"
    not_padded = [o for o in failed if o["mode"] not in PADDED_MODES]
    assert not not_padded, f"failures outside padded mode cannot be the mask failure:\n{describe(not_padded)}"
    failing, expected = {o["invariant"] for o in failed}, expected_mask_failures(outcomes)
    assert failing == expected, (
        f"verl {engine.caps.version}: failing {sorted(failing)}, the mask failure is {sorted(expected)}\n"
        f"not mask invariants: {sorted(failing - expected)}; mask invariants that passed: "
        f"{sorted(expected - failing)}\n{describe(failed)}")
    assert {"INV-MASK-001", "INV-MASK-003", "INV-VAL-001", "INV-KEYS-003"} <= failing


class _FullLengthMask:
    """A verl engine object whose padded attention mask is replaced by the full-length one."""

    def __init__(self, inner):
        self.inner = inner

    def prepare_model_inputs(self, micro_batch):
        model_inputs, output_args = self.inner.prepare_model_inputs(micro_batch)
        mask = model_inputs.get("attention_mask")
        if mask is not None:
            import torch

            lens = micro_batch["input_ids"].offsets().diff().to(mask.device)
            cols = torch.arange(mask.shape[-1], device=mask.device)
            model_inputs = {**model_inputs, "attention_mask": (cols < lens.unsqueeze(1)).to(mask.dtype)}
        return model_inputs, output_args

    def prepare_model_outputs(self, *args, **kwargs):
        return self.inner.prepare_model_outputs(*args, **kwargs)


class _MaskCorrectedVerl(VerlEngine):
    """The counterfactual: the installed verl with only its padded mask corrected."""

    def __init__(self) -> None:
        super().__init__()
        self.name = "verl+full-length-mask"

    def make(self, head: str = "lm", **settings):
        return _FullLengthMask(super().make(head, **settings))


def test_mask_failures_vanish_with_the_full_length_mask(engine: VerlEngine, mask_bug: bool,
                                                        verify_run: dict) -> None:
    """Each failing instance passes once only the mask is corrected: they are all the mask failure."""
    if not mask_bug:
        pytest.skip(f"verl {engine.caps.version} builds the padded mask from the full lengths")
    failed = [o for o in verdict_rows(verify_run["outcomes"]) if o["status"] == "fail"]
    fixed = _MaskCorrectedVerl()
    still = []
    for o in failed:
        outcome = run_invariant(CATALOGUE[o["invariant"]], fixed, o["mode"], "cpu", profile="ci")
        (result,) = verdict_rows([outcome.as_dict()]) or [outcome.as_dict()]
        if result["status"] not in ("pass", "xfail"):
            still.append(result)
    assert not still, f"failures that the full-length mask does not remove (not the mask failure):\n{describe(still)}"


def test_padded_mask_is_the_loss_mask_bug(engine: VerlEngine, mask_bug: bool) -> None:
    """The mechanism of #6278, shown directly: r_i ones per row, from the response-only loss_mask."""
    case, rows = padded_mask_rows(engine)
    assert rows == list(case.response_lens if mask_bug else case.seq_lens)


# -- what the adapter does to verl's helpers ----------------------------------------------------

def test_no_padding_2_padding_wrapper_changes_no_value(engine: VerlEngine) -> None:
    """verl 0.7.1's no_padding_2_padding needs data["attention_mask"] but never reads its value for
    nested input: any mask gives the same slice, so the adapter's added key changes nothing."""
    import torch

    fn = engine.helper("no_padding_2_padding")
    raw = getattr(fn, "__wrapped__", None)
    if raw is None:
        pytest.skip(f"verl {engine.caps.version}'s no_padding_2_padding needs no added key")
    case = EngineCase(prompt_lens=(3, 1, 2), response_lens=(2, 3, 1), max_response_len=4)
    mb = materialize(case)
    values = torch.nested.nested_tensor_from_jagged(torch.randn(case.total_nnz), mb["input_ids"].offsets())
    slices = []
    for fill in (0, 1, 7):
        data = mb.copy()
        data.set("attention_mask", torch.full((case.batch_size, max(case.seq_lens)), fill, dtype=torch.int64))
        slices.append(raw(values, data))
    wrapped = fn(values, mb)
    assert "attention_mask" not in mb.keys(), "the wrapper changed the caller's micro-batch"
    for got in slices:
        assert torch.equal(got, wrapped)


# -- verl's own companion: its top-K distillation processor ---------------------------------------

def test_own_processor_computes_the_oracle_s_terms(engine: VerlEngine) -> None:
    """verl's own top-K processor (the companion a real verl 0.9 run hands prepare_model_outputs) returns all five
    keys and computes what spec.truth.oracle.topk_terms defines, on each of its drawn switches (chunked or not, a
    short last chunk, clamped or not), float32 logits; the clamp changes the terms on these logits (it is checked,
    not idle). A verl without the processor gets the suite's stand-in, and says why."""
    import torch

    from spec.cases.structure import DISTILLATION_KEYS
    from spec.truth.oracle import topk_terms

    if engine.caps.own_processor_error is not None:
        assert engine.logits_processor(EngineCase((2,), (1,), distillation_keys=("student_mass",))) is None
        assert engine.companions()["logits_processor"].startswith("stand-in: ")
        pytest.skip(f"verl {engine.caps.version}: {engine.caps.own_processor_error}")
    assert engine.companions()["logits_processor"].startswith("own: ")
    gen = torch.Generator().manual_seed(0)
    for chunked, size, clamp in ((False, 4096, None), (True, 3, None), (False, 4096, -1.0), (True, 2, -1.0)):
        case = EngineCase(prompt_lens=(3, 2), response_lens=(2, 4), vocab=16, topk=3, distillation_keys=DISTILLATION_KEYS,
                          engine_config=(("use_chunked_topk", chunked), ("chunked_topk_chunk_size", size),
                                         ("log_prob_min_clamp", clamp)))
        mb = materialize(case)
        logits = 3 * torch.randn(1, case.total_nnz, case.vocab, generator=gen)
        got = engine.logits_processor(case)(student_logits=logits, data=mb)
        assert set(got) == set(DISTILLATION_KEYS) == set(engine.processor_keys(case))
        ids, lp = mb["teacher_ids"].values(), mb["teacher_logprobs"].values()
        want = topk_terms(logits[0], ids, lp, clamp)
        for key in DISTILLATION_KEYS:
            assert got[key].shape == (1, case.total_nnz), (key, tuple(got[key].shape))
            torch.testing.assert_close(got[key][0].double(), want[key], atol=1e-5, rtol=1e-5, msg=f"{key} {case}")
        if clamp is not None:
            plain = topk_terms(logits[0], ids, lp)
            assert not torch.allclose(plain["distillation_losses"], want["distillation_losses"])


def test_reproducer_hands_verl_its_own_processor(engine: VerlEngine, tmp_path) -> None:
    """A distillation reproducer builds and hands verl the processor the adapter hands it (0.9: its own
    distillation_ppo_loss with the case's drawn switches) and exits 0 on a case verl gets right; the same file with
    that processor taken out (the written-out stand-in, which never clamps) exits 1 on the clamped case, so the file
    runs verl's own. verl 0.7.1 ships none: its file hands the stand-in, as the adapter does."""
    from spec.cases.structure import DISTILLATION_KEYS
    from spec.repro.writer import write_reproducer

    case = EngineCase(prompt_lens=(2, 3), response_lens=(3, 2), vocab=16, topk=2, temperature=0.7, seed=5,
                      distillation_keys=DISTILLATION_KEYS,
                      engine_config=(("log_prob_min_clamp", -1.0), ("use_chunked_topk", True),
                                     ("chunked_topk_chunk_size", 3)))
    path, why = write_reproducer(tmp_path / "own.py", invariant="INV-VAL-004", mode="packed", engine=engine, case=case)
    assert why is None, why
    text = path.read_text()
    if engine.caps.own_processor_error is not None:
        assert "def logits_processor(" not in text and "distillation_ppo_loss" not in text
        pytest.skip(f"verl {engine.caps.version}: {engine.caps.own_processor_error}")
    assert "def logits_processor(" in text and "distillation_ppo_loss" in text
    stand_in = tmp_path / "stand_in.py"
    stand_in.write_text(text.replace("def logits_processor(", "def _not_handed_logits_processor("))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    runs = {p.name: subprocess.run([sys.executable, str(p)], capture_output=True, text=True, env=env, cwd=str(tmp_path),
                                   timeout=600) for p in (path, stand_in)}
    assert runs["own.py"].returncode == 0 and "PASS: INV-VAL-004" in runs["own.py"].stdout, runs["own.py"].stdout
    assert runs["stand_in.py"].returncode == 1 and "FAIL INV-VAL-004 (values)" in runs["stand_in.py"].stdout, \
        runs["stand_in.py"].stdout
