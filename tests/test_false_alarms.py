"""No false alarms on correct engines laid out differently (ten defects of the suite's own), and the bugs still caught.

The engines are tests/false_alarm_engines.py: impl changed where no consumer can tell, or in a layout it declares
through the protocol. Each test checks pinned cases directly (``check``: the invariant's adjust, what the runner
does for the engine, then its check) and, where cheap, the runner under the ``dev`` profile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import impl
from spec.execute.attribution import AttributedEngine
from spec.cases import EngineCase
from spec.run.registry import load_engine
from spec.invariants import CATALOGUE, Ctx
from spec.invariants import core
from spec.run.runner import Outcome, run_invariant

ROOT = Path(__file__).resolve().parents[1]
ENGINES = "tests.false_alarm_engines"


def engine(name: str):
    return load_engine(f"{ENGINES}:{name}")


def check(eng, invariant: str, case: EngineCase) -> None:
    """Run one invariant's check on ``case`` as the runner would (its adjust, then the engine's limits)."""
    info = CATALOGUE[invariant]
    case = info.adjust(case) if info.adjust else case
    honour = getattr(core, "honour_engine", None)
    case = honour(case, eng) if honour is not None else case
    mode = case.mode if set(info.modes) & {"packed", "padded"} else info.modes[0]
    info.check(Ctx(AttributedEngine(eng), case, "cpu", mode))


def verdict(eng, invariants: list[str], examples: int = 12) -> dict[str, Outcome]:
    out = {}
    for inv in invariants:
        info = CATALOGUE[inv]
        for mode in info.modes:
            out[f"{inv}/{mode}"] = run_invariant(info, eng, mode, "cpu", profile="dev", max_examples=examples)
    return out


def assert_passes(outcomes: dict[str, Outcome]) -> None:
    bad = {k: f"{o.counterexample} -> {o.error}" for k, o in outcomes.items() if o.status not in ("pass", "skip")}
    assert not bad, bad


PAIR = EngineCase(prompt_lens=(2, 1), response_lens=(1, 2), vocab=5, calculate_entropy=True,
                  calculate_sum_pi_squared=True, seed=4)
UNEQUAL = EngineCase(prompt_lens=(3, 1, 2), response_lens=(1, 2, 2), vocab=7, calculate_entropy=True,
                     use_remove_padding=False, seed=5)  # lengths 4, 3, 4: padding in either layout


# -- 1: outputs at a position no consumer reads (each sequence's last token) are not asserted -------------------

@pytest.mark.parametrize("invariant", ["INV-VAL-002", "INV-VAL-003", "INV-LEAK-001", "INV-LEAK-002", "INV-KEYS-003",
                                       "INV-BATCH-001", "INV-BATCH-003"])
@pytest.mark.parametrize("mode", ["packed", "padded"])
def test_last_token_output_is_not_asserted(invariant, mode) -> None:
    check(engine("LastTokenUnset"), invariant, PAIR.with_(use_remove_padding=mode == "packed"))


def test_last_token_value_is_not_asserted() -> None:
    check(engine("LastTokenUnset"), "INV-VAL-005", PAIR.with_(head="value", calculate_entropy=False,
                                                              calculate_sum_pi_squared=False))


@pytest.mark.parametrize("invariant", ["INV-VAL-002", "INV-VAL-003", "INV-VAL-001"])
def test_outputs_inside_a_sequence_are_still_asserted(invariant) -> None:
    """The exemption is the last token only: a wrong output anywhere else still fails."""
    with pytest.raises(AssertionError, match="of sequence 0"):
        check(engine("WrongFirstToken"), invariant, PAIR)


# -- 2: one temperature per trainer ---------------------------------------------------------------------------

@pytest.mark.parametrize("invariant", ["INV-BATCH-001", "INV-BATCH-002", "INV-TEMP-001", "INV-TEMP-006",
                                       "INV-TEMP-004", "INV-TEMP-005", "INV-BATCH-003"])
def test_one_temperature_per_trainer(invariant) -> None:
    for mode in CATALOGUE[invariant].modes:
        check(engine("OneTemperature"), invariant, PAIR.with_(use_remove_padding=mode == "packed"))


def test_one_temperature_per_trainer_verdict() -> None:
    outcomes = verdict(engine("OneTemperature"), ["INV-BATCH-001", "INV-BATCH-002", "INV-TEMP-001", "INV-TEMP-002",
                                                  "INV-ERR-003"], examples=8)
    assert_passes(outcomes)
    assert outcomes["INV-TEMP-002/packed"].status == "skip" and "one temperature" in outcomes["INV-TEMP-002/packed"].reason
    assert engine("OneTemperature").lacks("per_sample_temperature")
    assert load_engine("impl").lacks("per_sample_temperature") is None


def test_shared_temperature_is_still_applied() -> None:
    """With one shared temperature, TEMP-001 still rejects an engine that ignores it."""
    with pytest.raises(AssertionError):
        check(load_engine("planted:no_temperature_padded"), "INV-TEMP-001",
              PAIR.with_(temperature=0.5, use_remove_padding=False))


# -- 3: NaN equal to NaN in run-vs-run comparisons; one diagnosis per root cause ----------------------------------

COLD_FP16 = EngineCase(prompt_lens=(2, 1), response_lens=(1, 2), vocab=5, temperature=1e-8, logits_dtype="float16",
                       calculate_entropy=True, seed=3)


@pytest.mark.parametrize("invariant", ["INV-BATCH-001", "INV-BATCH-002", "INV-BATCH-003", "INV-KEYS-003",
                                       "INV-CHUNK-001", "INV-SP-001", "INV-SP-002", "INV-MUT-005"])
def test_an_engine_nan_is_not_a_run_difference(invariant) -> None:
    mode = "packed" if CATALOGUE[invariant].modes in (("packed",), ("both",)) else "padded"
    check(engine("Fp16NanAtClamp"), invariant, COLD_FP16.with_(use_remove_padding=mode == "packed"))


def test_the_value_invariant_reports_the_nan_once() -> None:
    with pytest.raises(AssertionError, match="log_probs"):
        check(engine("Fp16NanAtClamp"), "INV-VAL-001", COLD_FP16)


def test_a_real_run_difference_is_still_caught() -> None:
    with pytest.raises(AssertionError):
        check(load_engine("planted:chunk_drops_tail"), "INV-CHUNK-001",
              EngineCase(prompt_lens=(3, 2), response_lens=(3, 2), vocab=7, entropy_chunk_size=4, seed=1))


def test_report_groups_failures_sharing_a_counterexample() -> None:
    from spec.report import by_counterexample, markdown

    case = repr(COLD_FP16)
    outcomes = [Outcome("INV-VAL-001", "e", "packed", "cpu", "fail", counterexample=case, error="nan"),
                Outcome("INV-TEMP-006", "e", "packed", "cpu", "fail", counterexample="other", error="x",
                        other_failures=[{"status": "fail", "counterexample": case, "error": "nan"}]),
                Outcome("INV-VAL-002", "e", "padded", "cpu", "fail", counterexample="alone", error="y")]
    groups = by_counterexample(outcomes)
    assert [(c, [o.invariant for o in m]) for c, m in groups] == [(case, ["INV-VAL-001", "INV-TEMP-006"])]
    assert "sharing a minimal counterexample" in markdown(outcomes, engine="e", profile="dev", device="cpu")


# -- 4: a NaN the engine computes on an unpadded single sequence is no leak -----------------------------------

@pytest.mark.parametrize("mode", ["packed", "padded"])
@pytest.mark.parametrize("invariant", ["INV-LEAK-001", "INV-LEAK-002"])
def test_an_engine_nan_is_not_a_leak(invariant, mode) -> None:
    case = COLD_FP16.with_(use_remove_padding=mode == "packed", pad_to_length=8 if mode == "packed" else None)
    check(engine("Fp16NanAtClamp"), invariant, case)


@pytest.mark.parametrize("bug, invariant", [("global_max_shift", "INV-LEAK-001"),
                                             ("nan_to_num_then_global_shift", "INV-LEAK-002")])
def test_a_padding_leak_is_still_caught(bug, invariant) -> None:
    with pytest.raises(AssertionError, match="padding"):
        check(load_engine(f"planted:{bug}"), invariant, UNEQUAL)


# -- 5: padded layouts as a declared choice -----------------------------------------------------------------------

LAYOUT_CHECKS = ["INV-MASK-001", "INV-MASK-003", "INV-INPUT-001", "INV-INPUT-002", "INV-POS-001", "INV-POS-003",
                 "INV-VAL-001", "INV-VAL-002", "INV-LEAK-001", "INV-LEAK-002", "INV-SLICE-002", "INV-KEYS-003"]


@pytest.mark.parametrize("invariant", LAYOUT_CHECKS)
@pytest.mark.parametrize("mrope", [False, True])
def test_left_right_layout_passes_when_declared(invariant, mrope) -> None:
    check(engine("LeftRightPadded"), invariant, UNEQUAL.with_(mrope=mrope))


@pytest.mark.parametrize("name", ["WrongLeftRightDeclaredRight", "WrongRightDeclaredLeftRight"])
@pytest.mark.parametrize("invariant", ["INV-MASK-001", "INV-INPUT-001", "INV-VAL-001"])
def test_a_layout_other_than_declared_fails(name, invariant) -> None:
    with pytest.raises(AssertionError):
        check(engine(name), invariant, UNEQUAL)


def test_verl_mask_bug_still_fails_on_the_mask() -> None:
    with pytest.raises(AssertionError, match="attention_mask row"):
        check(load_engine("planted:loss_mask_attention"), "INV-MASK-001", UNEQUAL)


def test_left_right_layout_verdict() -> None:
    assert_passes(verdict(engine("LeftRightPadded"), ["INV-MASK-001", "INV-MASK-003", "INV-INPUT-001",
                                                      "INV-VAL-001", "INV-LEAK-001"], examples=10))


# -- 6: the pytest plugin and `spec verify` agree -------------------------------------------------------------------

def _entry_point_installed() -> bool:
    import importlib.metadata

    return any(ep.value == "spec.pytest_plugin" for ep in importlib.metadata.entry_points(group="pytest11"))


def _env() -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore", "SPEC_EXAMPLE_DB": "none"}
    env.pop("PYTEST_XDIST_WORKER", None)
    return env


@pytest.mark.parametrize("name", ["spec.planted.harmless:LastLabelPad",
                                  "planted:labels_masked_at_pad_id"])
def test_plugin_and_verify_agree(tmp_path, name) -> None:
    # the ci profile: derandomized, so both runs draw the same cases (a quiet bug under `dev` is found by chance)
    verify = subprocess.run([sys.executable, "-m", "spec", "verify", "--engine", name, "--profile", "ci",
                             "--only", "INV-LABEL", "--out", str(tmp_path / "v")], cwd=ROOT, env=_env(),
                            capture_output=True, text=True, timeout=900)
    (tmp_path / "repo").mkdir()
    load = [] if _entry_point_installed() else ["-p", "spec.pytest_plugin"]
    plugin = subprocess.run([sys.executable, "-m", "pytest", *load, "-p", "no:cacheprovider",
                             "-q", "--ioprep-engine", name, "--ioprep-profile", "ci", "--ioprep-only", "INV-LABEL",
                             "--ioprep-report", str(tmp_path / "p")], cwd=tmp_path / "repo", env=_env(),
                            capture_output=True, text=True, timeout=900)
    both = []
    for folder in ("v", "p"):
        (report,) = (tmp_path / folder).glob("verify-*.json")
        both.append(json.loads(report.read_text()))
    statuses = [{o["test_id"]: o["status"] for o in r["outcomes"]} for r in both]
    assert statuses[0] == statuses[1]
    assert both[0]["verdict"] == both[1]["verdict"]
    assert (verify.returncode == 0) == (plugin.returncode == 0), (verify.stdout[-2000:], plugin.stdout[-3000:])
    assert (verify.returncode == 0) == (both[0]["verdict"] == "pass")


# -- 8: the fused-head protocol ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_fused_head_logits_are_exact_in_float32(dtype) -> None:
    from spec.truth.toy_model import ToyCausalLM

    model = ToyCausalLM(152_064, seed=1, dtype=dtype, head_input="hidden")
    ids = torch.randint(0, 152_064, (1, 7))
    pos = torch.arange(7).unsqueeze(0)
    out = model(ids, pos)
    assert not hasattr(out, "logits") and out.hidden_states.dtype == out.lm_head_weight.dtype == model.dtype
    assert out.lm_head_weight.shape == (152_064, 8) and out.hidden_states.shape == (1, 7, 8)
    product = out.hidden_states.float() @ out.lm_head_weight.float().T
    assert torch.equal(product, model.logits(ids, pos))
    assert torch.equal((out.hidden_states.float().flip(-1) @ out.lm_head_weight.float().flip(-1).T), product)


@pytest.mark.parametrize("invariant", ["INV-VAL-001", "INV-VAL-002", "INV-VAL-003", "INV-VAL-004", "INV-LEAK-001",
                                       "INV-LEAK-002", "INV-SLICE-002", "INV-KEYS-003", "INV-MUT-002"])
@pytest.mark.parametrize("vocab, dtype", [(7, "bfloat16"), (152_064, "float32"), (65_537, "float16")])
def test_fused_head_engine_passes_at_every_tier(invariant, vocab, dtype) -> None:
    case = EngineCase(prompt_lens=(3, 2), response_lens=(2, 3), vocab=vocab, logits_dtype=dtype, temperature=0.7,
                      calculate_entropy=True, seed=2)
    for mode in ("packed", "padded"):
        check(engine("FusedHead"), invariant, case.with_(use_remove_padding=mode == "packed"))


def test_fused_head_verdict() -> None:
    assert_passes(verdict(engine("FusedHead"), ["INV-VAL-001", "INV-VAL-002", "INV-LEAK-001"], examples=10))


# -- 9: real ranks: a label no response slice reads --------------------------------------------------------------

RANKS = EngineCase(prompt_lens=(1,), response_lens=(1,), vocab=3, sp_size=2, pad_token_id=0, seed=0)


def _real_ranks():
    from spec.execute.ranks import unavailable

    reason = unavailable("cpu", 2)
    if reason:
        pytest.skip(reason)


@pytest.mark.parametrize("case", [RANKS, EngineCase(prompt_lens=(2, 1, 3), response_lens=(1, 2, 2), vocab=5,
                                                    sp_size=3, pad_token_id=4, seed=7)])
def test_ranks_do_not_assert_unread_labels(case) -> None:
    _real_ranks()
    check(engine("LastLabelPadRanks"), "INV-RANK-002", case)


def test_ranks_exact_row_is_a_layout_check() -> None:
    _real_ranks()
    assert CATALOGUE["INV-RANK-008"].layout and not CATALOGUE["INV-RANK-002"].layout
    with pytest.raises(AssertionError, match="rolled labels"):
        check(engine("LastLabelPadRanks"), "INV-RANK-008", RANKS)


def test_ranks_roll_after_slice_still_fails() -> None:
    _real_ranks()
    with pytest.raises(AssertionError, match="rolled labels"):
        check(load_engine("planted:rank_roll_after_slice"), "INV-RANK-002", RANKS)


# -- 10: consumer views of other frameworks ---------------------------------------------------------------------

def test_consumer_views_equal_verls_slice() -> None:
    from spec.execute.harness import execute
    from spec.protocol import action_view, completion_view, response_view, sequences_from_responses

    case = EngineCase(prompt_lens=(3, 1, 2), response_lens=(1, 3, 2), vocab=7, max_response_len=4, seed=1)
    run = execute(load_engine("impl"), case)
    lp = run.outputs["log_probs"]
    want = impl.no_padding_2_padding(lp, run.micro_batch)
    for view in (response_view, completion_view, action_view):
        got, mask = view(lp, run.micro_batch)
        assert torch.equal(got, want) and mask.tolist() == [[1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 0, 0]]
    back = sequences_from_responses(want, run.micro_batch)
    assert torch.equal(response_view(back, run.micro_batch)[0], want)
    assert torch.isnan(back.values()).sum() == case.total_nnz - sum(case.response_lens)


@pytest.mark.parametrize("invariant", ["INV-VAL-001", "INV-VAL-002", "INV-LEAK-001", "INV-KEYS-003", "INV-SLICE-006",
                                       "INV-BATCH-001", "INV-SLICE-002"])
def test_response_only_outputs_are_checked_where_read(invariant) -> None:
    for mode in ("packed", "padded"):
        check(engine("ResponseOnly"), invariant, PAIR.with_(use_remove_padding=mode == "packed"))


def test_response_view_catches_a_shifted_slice() -> None:
    with pytest.raises(AssertionError, match="log_probs"):
        check(engine("WrongShiftedResponses"), "INV-SLICE-006", PAIR)
