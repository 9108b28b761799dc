"""TRL and OpenRLHF adapters (spec/engines/trl/README.md, spec/engines/openrlhf/README.md): registered, their known failures precise
and documented; where the library is installed (the trl and openrlhf CI steps, spec/engines/{trl,openrlhf}/ci.sh), the
batch each builds is the library's layout and its outputs equal the oracle's on the seeds' worked example."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from spec.cases import EngineCase
from spec.cases.materialize import draws
from spec.cases.structure import Media
from spec.run.registry import ENGINES, load_engine
from spec.execute.harness import execute, model_for
from spec.truth.oracle import expected
from spec.invariants import CATALOGUE
from spec.protocol.known import KnownFailure
from spec.engines.openrlhf import records as openrlhf_records
from spec.engines.trl import records as trl_records

ENGINES_DIR = Path(__file__).resolve().parents[1] / "spec" / "engines"
HAS = {"trl": importlib.util.find_spec("trl") is not None, "openrlhf": importlib.util.find_spec("openrlhf") is not None}
#: the seeds' worked example: prompts [3, 2], responses [2, 1]
CASE = EngineCase(prompt_lens=(3, 2), response_lens=(2, 1), vocab=8, temperature=0.5, calculate_entropy=True)


def test_registered() -> None:
    for name in ("trl", "trl-fused", "openrlhf"):
        assert name in ENGINES and load_engine(name).name == name


@pytest.mark.parametrize("records, page", [(trl_records.LOGITS_RECORDS + trl_records.FUSED_RECORDS, "trl"),
                                           (openrlhf_records.RECORDS, "openrlhf")])
def test_known_failures_are_precise_documented_records(records, page: str) -> None:
    doc = (ENGINES_DIR / page / "README.md").read_text()
    for record in records:
        assert isinstance(record, KnownFailure) and record.invariant in CATALOGUE, record
        assert record.when.text and record.matches and record.invariant in doc, record.key


def _values(run) -> dict[str, list[float]]:
    return {k: v.values().tolist() for k, v in run.outputs.items()}


@pytest.mark.skipif(not HAS["trl"], reason="trl is not installed (the trl CI step)")
@pytest.mark.parametrize("name", ["trl", "trl-fused"])
def test_trl_builds_grpo_layout_and_agrees_across_modes(name: str) -> None:
    engine = load_engine(name)
    run = execute(engine, CASE.with_(use_remove_padding=False))
    mask = run.inputs[0]["attention_mask"]
    # prompts left-padded to P = 3, completions right-padded to C = 2 (trl.trainer.utils.pad, as GRPO builds them)
    assert mask.tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 1, 0]]
    ids = run.micro_batch["input_ids"]
    assert run.inputs[0]["input_ids"][1, 1:4].tolist() == ids[1].tolist()
    packed = execute(engine, CASE)
    # padded outputs are completion-only (logits_to_keep): the positions scoring a response token, NaN elsewhere
    read = [2, 3, 6]  # p_i - 1 .. n_i - 2 of sequences (3 + 2) and (2 + 1)
    for key, values in _values(run).items():
        assert [i for i, v in enumerate(values) if v == v] == read, key
        assert torch.allclose(torch.tensor(values)[read], torch.tensor(_values(packed)[key])[read], atol=1e-5), key


@pytest.mark.skipif(not HAS["openrlhf"], reason="openrlhf is not installed (the openrlhf CI step)")
def test_openrlhf_forward_runs_on_right_padded_rows_and_agrees_across_modes() -> None:
    engine = load_engine("openrlhf")
    run = execute(engine, CASE.with_(use_remove_padding=False))
    assert run.inputs[0]["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    packed = execute(engine, CASE)
    assert packed.inputs[0]["input_ids"].shape == (1, 8) and packed.inputs[0]["attention_mask"] is None
    ends = set((run.micro_batch["input_ids"].offsets()[1:] - 1).tolist())
    for key, values in _values(packed).items():
        kept = [i for i in range(len(values)) if i not in ends]
        assert torch.allclose(torch.tensor(values)[kept], torch.tensor(_values(run)[key])[kept], atol=1e-5), key


#: a vision-language micro-batch (padded): sample 0 an image of 2 x 4 patches (2 tokens) after one text token, sample 1
#: text only
VLM_CASE = EngineCase(prompt_lens=(4, 2), response_lens=(2, 1), vocab=16, mrope=True, use_remove_padding=False,
                      calculate_entropy=True, media=((Media("image", 1, 2, 4, 1),), ()))


def _oracle_log_probs(engine, case, run) -> None:
    want = expected(case, model_for(case, "cpu", engine), draws(case)).log_probs
    got = run.outputs["log_probs"].unbind()
    for i, (p, r) in enumerate(zip(case.prompt_lens, case.response_lens)):
        cols = torch.arange(p - 1, p + r - 1)
        assert torch.allclose(got[i][cols].double(), want[i][cols], atol=1e-5), i


@pytest.mark.skipif(not HAS["trl"], reason="trl is not installed (the trl CI step)")
def test_grpo_hands_the_backbone_the_batch_images() -> None:
    engine = load_engine("trl-fused")
    run = execute(engine, VLM_CASE)
    inputs, media = run.inputs[0], draws(VLM_CASE).media_inputs()
    assert torch.equal(inputs["pixel_values"], media["pixel_values"]) and inputs["image_grid_thw"].tolist() == [[1, 2, 4]]
    # the processor's token types, prompts left-padded to 4, extended with zeros over the completions (width 2)
    assert inputs["mm_token_type_ids"].tolist() == [[0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]]
    _oracle_log_probs(engine, VLM_CASE, run)


@pytest.mark.skipif(not HAS["openrlhf"], reason="openrlhf is not installed (the openrlhf CI step)")
def test_openrlhf_merges_each_experience_sample_images() -> None:
    engine = load_engine("openrlhf")
    run = execute(engine, VLM_CASE)
    inputs, media = run.inputs[0], draws(VLM_CASE).media_inputs()
    assert torch.equal(inputs["pixel_values"], media["pixel_values"]) and inputs["position_ids"].shape == (4, 2, 6)
    assert inputs["mm_token_type_ids"].tolist() == [[0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]]
    _oracle_log_probs(engine, VLM_CASE, run)


@pytest.mark.skipif(not HAS["trl"], reason="trl is not installed (the trl CI step)")
@pytest.mark.parametrize("invariant, code", [("INV-VAL-001", 0), ("INV-MUT-002", 0), ("INV-FLAG-004", 1)])
def test_a_fused_head_reproducer_runs_standalone(tmp_path, invariant: str, code: int) -> None:
    """trl-fused's reproducers hand its head hidden states and the LM-head weight, as the suite's model does (they
    crashed on 'hidden_states' before): the oracle check and the snapshot of the model's output pass standalone, and
    the declared temperature refusal fails on T = -1.0 (FUSED_TEMPERATURE), by the check, not a crash."""
    from spec.repro import run_reproducer, write_reproducer
    path, why = write_reproducer(tmp_path / "fused.py", invariant=invariant, mode="packed",
                                 engine=load_engine("trl-fused"), case=CASE)
    assert why is None and "HEAD_INPUT = 'hidden'" in path.read_text()
    got, printed = run_reproducer(path)
    assert got == code, printed
    assert code == 0 or "temperature=-1.0" in printed and "expected the engine to raise" in printed, printed


@pytest.mark.skipif(not HAS["trl"], reason="trl is not installed (the trl CI step)")
def test_per_sample_as_per_image_reproduces_standalone(tmp_path) -> None:
    """TRL's PER_SAMPLE_AS_PER_IMAGE (Idefics3's per-sample images scored in chunks, two, none and one image over
    three rows) reproduces without the suite: INV-MM-001's reproducer exits 1, the model handed other rows' image
    slots; the same case in LLaVA-NeXT's per-image layout passes."""
    from spec.engines.trl.records import PER_SAMPLE_LAYOUT
    from spec.engines.trl.vision_families import FAMILY_CASES
    from spec.repro import run_reproducer, write_reproducer
    for family, code in (("idefics3", 1), ("llava_next", 0)):
        case = next(c for c in FAMILY_CASES if dict(c.engine_config)["vision_family"] == family)
        case = case.with_(use_remove_padding=False)
        assert PER_SAMPLE_LAYOUT(case) == bool(code)
        path, why = write_reproducer(tmp_path / f"{family}.py", invariant="INV-MM-001", mode="padded",
                                     engine=load_engine("trl-fused"), case=case)
        assert why is None
        got, printed = run_reproducer(path)
        assert got == code and (not code or "hold other image slots" in printed), printed
