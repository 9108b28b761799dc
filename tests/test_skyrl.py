"""SkyRL adapters (spec/engines/skyrl/README.md): registered, their known failures precise and documented; where the library is
installed (spec/engines/skyrl/ci.sh), the batch each builds is SkyRL's own layout (0.3.1 left-right, 0.4.0 left) and
its outputs equal the float64 oracle's on the seeds' worked example, in both modes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from spec.cases import EngineCase
from spec.cases.structure import Media
from spec.cases.materialize import draws
from spec.engines.skyrl import config as skyrl_config, records as skyrl_records
from spec.cases.materialize import materialize
from spec.engines.kit.hf_batch import left_aligned, sequences_from_masked_rows
from spec.protocol import sequences_from_responses
from spec.engines.skyrl.sequence_parallel import ulysses_rank
from spec.execute.harness import execute, model_for
from spec.execute.ranks import unavailable
from spec.invariants import CATALOGUE
from spec.protocol.known import KnownFailure
from spec.run.registry import ENGINES, load_engine
from spec.truth.oracle import expected

DOCS = Path(__file__).resolve().parents[1] / "spec" / "engines" / "skyrl" / "README.md"
HAS = {"skyrl-train": importlib.util.find_spec("skyrl_train") is not None,
       "skyrl": importlib.util.find_spec("skyrl") is not None}
#: the seeds' worked example: prompts [3, 2], responses [2, 1]
CASE = EngineCase(prompt_lens=(3, 2), response_lens=(2, 1), vocab=8, temperature=0.5, calculate_entropy=True)
#: the attention mask of each version's batch (0.3.1: prompts left-padded to 3, responses right-padded to 2;
#: 0.4.0: whole rows left-padded to max n_i = 5)
MASKS = {"skyrl-train": [[1, 1, 1, 1, 1], [0, 1, 1, 1, 0]], "skyrl": [[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]}


def test_registered() -> None:
    for name in ("skyrl-train", "skyrl"):
        assert name in ENGINES and load_engine(name).name == name
    assert load_engine("skyrl-train").profile.positions == ("rope",)  # 0.3.1: no vision path
    new = load_engine("skyrl").profile  # 0.4.0: its VLM (mRoPE, images) refuses packing
    assert (new.positions, new.media, new.mrope_modes) == (("rope", "mrope"), ("image",), ("padded",))


#: a vision-language micro-batch: sample 0 an image of 2 x 4 patches (2 tokens) after one text token, sample 1 text only
VLM_CASE = EngineCase(prompt_lens=(4, 2), response_lens=(2, 1), vocab=16, mrope=True, use_remove_padding=False,
                      calculate_entropy=True, media=((Media("image", 1, 2, 4, 1),), ()))


def test_the_vlm_path_takes_the_images_as_skyrl_hands_them() -> None:
    if not HAS["skyrl"]:
        pytest.skip("skyrl is not installed (spec/engines/skyrl/ci.sh)")
    engine = load_engine("skyrl")
    run = execute(engine, VLM_CASE)
    inputs, media = run.inputs[0], draws(VLM_CASE).media_inputs()
    # forward concatenated the per-sample TensorLists (sample 1's an empty placeholder) and marked the image tokens
    assert torch.equal(inputs["pixel_values"], media["pixel_values"])
    assert torch.equal(inputs["image_grid_thw"], media["image_grid_thw"])
    assert inputs["mm_token_type_ids"].tolist() == [[0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]]
    assert inputs["position_ids"].shape == (4, 2, 6)  # the VLM's own positions, in SkyRL's left-padded rows
    _assert_the_oracles(engine, VLM_CASE, run)


def test_a_vlm_handed_grids_without_token_types_is_left_without_positions() -> None:
    """The adapter hands the stand-in a VLM's own mRoPE positions only where the model could compute them: beside
    ``mm_token_type_ids``, or with no grids at all; forward handing grids without the marks (a transformers-5 model
    raises there) leaves the view without positions, so INV-MM-001 asks for the marks (a mutant of forward's line
    that builds them survived before: spec mutate --engine skyrl)."""
    from spec.cases.materialize import materialize
    from spec.engines.skyrl.media import with_own_positions

    mb = materialize(VLM_CASE)
    grids = {"input_ids": torch.zeros(2, 6, dtype=torch.long), "image_grid_thw": torch.tensor([[1, 2, 4]])}
    assert "position_ids" not in with_own_positions(dict(grids), {"vlm": True}, mb)
    marked = with_own_positions({**grids, "mm_token_type_ids": torch.zeros(2, 6)}, {"vlm": True}, mb)
    assert marked["position_ids"].shape == (4, 2, 6)
    assert "position_ids" in with_own_positions({"input_ids": grids["input_ids"]}, {"vlm": True}, mb)
    # a text-only sub-batch of a VLM: forward hands the image keys as None
    assert "position_ids" in with_own_positions({**grids, "image_grid_thw": None, "pixel_values": None}, {"vlm": True}, mb)
    assert "position_ids" not in with_own_positions(dict(grids), {"vlm": False}, mb)  # a text model: as handed


def _assert_the_oracles(engine, case: EngineCase, run) -> None:
    """``run``'s log-probs and entropy equal the float64 oracle's at every position that scores a response token."""
    want = expected(case, model_for(case, "cpu", engine), draws(case))
    for key in ("log_probs", "entropy"):
        got = run.outputs[key].unbind()
        for i, (p, r) in enumerate(zip(case.prompt_lens, case.response_lens)):
            cols = torch.arange(p - 1, p + r - 1)
            assert torch.allclose(got[i][cols].double(), want.__dict__[key][i][cols], atol=1e-5), (key, i)


def test_known_failures_are_precise_documented_records() -> None:
    doc = DOCS.read_text()
    for record in skyrl_records.RECORDS:
        assert isinstance(record, KnownFailure) and record.invariant in CATALOGUE, record
        assert record.when.text and record.matches and record.invariant in doc, record.key
    assert not any("SUITE FALSE ALARM" in r.reason for r in skyrl_records.LIBRARY_RECORDS)


def test_left_aligned_moves_right_aligned_rows() -> None:
    rows = torch.tensor([[0.0, 1.0, 2.0], [0.0, 0.0, 5.0]])
    assert left_aligned(rows, torch.tensor([2, 1]))[:, :2].tolist() == [[1.0, 2.0], [5.0, 0.0]]


def test_outputs_are_read_at_the_librarys_response_mask() -> None:
    """SkyRL's response-only rows are read where its own response mask is set (as its trainer reads them), whatever
    the alignment; a mask that marks another count than a row's responses is refused, naming the counts."""
    mb = materialize(CASE, "cpu")  # responses [2, 1]
    rows = torch.tensor([[1.0, 2.0], [0.0, 5.0]])
    right = sequences_from_masked_rows({"log_probs": rows}, mb, torch.tensor([[1, 1], [0, 1]]))["log_probs"]
    left = sequences_from_masked_rows({"log_probs": torch.tensor([[1.0, 2.0], [5.0, 0.0]])}, mb,
                                      torch.tensor([[1, 1], [1, 0]]))["log_probs"]  # 0.3.1's right-padded rows
    want = sequences_from_responses(torch.tensor([[1.0, 2.0], [5.0, 0.0]]), mb)
    assert torch.equal(right.values().nan_to_num(-1), want.values().nan_to_num(-1))
    assert torch.equal(left.values().nan_to_num(-1), want.values().nan_to_num(-1))
    with pytest.raises(ValueError, match=r"marks \[2, 0\] tokens per row"):
        sequences_from_masked_rows({"log_probs": rows}, mb, torch.tensor([[1, 1], [0, 0]]))


@pytest.mark.parametrize("name", ["skyrl-train", "skyrl"])
def test_batch_layout_and_outputs_equal_the_oracle(name: str) -> None:
    if not HAS[name]:
        pytest.skip(f"{name} is not installed (spec/engines/skyrl/ci.sh)")
    engine = load_engine(name)
    want = expected(CASE, model_for(CASE, "cpu", engine), draws(CASE))
    read = [torch.arange(p - 1, p + r - 1) for p, r in zip(CASE.prompt_lens, CASE.response_lens)]
    for packed in (False, True):
        run = execute(engine, CASE.with_(use_remove_padding=packed))
        inputs = run.inputs[0]
        if packed:  # unpad_input of SkyRL's rows: one (1, 8) row, positions restarting at 0, no mask
            assert inputs["input_ids"].shape == (1, 8) and inputs["attention_mask"] is None
            assert inputs["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
        else:  # SkyRL's own batch; positions cumsum(mask) - 1, 1 on padding
            assert inputs["attention_mask"].tolist() == MASKS[name]
            assert inputs["position_ids"][1].tolist() == ([1, 0, 1, 2, 1] if name == "skyrl-train" else [1, 1, 0, 1, 2])
        for key in ("log_probs", "entropy"):
            got = run.outputs[key].unbind()
            for i, cols in enumerate(read):  # the positions scoring a response token (NaN elsewhere: never read)
                assert torch.allclose(got[i][cols].double(), want.__dict__[key][i][cols], atol=1e-5), (name, key, i)


def test_ulysses_needs_a_real_process_group() -> None:
    """sp_size 1 runs without a group; above 1 an all_gather without a process group is refused (SkyRL's Ulysses path
    reads one), never run as one rank."""
    assert ulysses_rank(1, 0, None, "SkyRL") == (1, None)
    with pytest.raises(NotImplementedError, match="process group"):
        ulysses_rank(2, 0, lambda local: local, "SkyRL")


@pytest.mark.parametrize("name", ["skyrl-train", "skyrl"])
def test_ulysses_on_real_ranks_scores_what_one_rank_does(name: str) -> None:
    """sp = 2 on real ranks (SkyRL's own slicing and gather): each rank's outputs are the single-rank run's, and the
    labels it scores are its shard of the rolled row as SkyRL cut it (7 tokens + 1 pad over 2 ranks)."""
    if not HAS[name]:
        pytest.skip(f"{name} is not installed (spec/engines/skyrl/ci.sh)")
    if unavailable("cpu", 2):
        pytest.skip(unavailable("cpu", 2))
    engine, case = load_engine(name), CASE.with_(prompt_lens=(3, 2), response_lens=(1, 1))
    single, sharded = execute(engine, case), execute(engine, case.with_(sp_size=2))
    row = torch.roll(torch.cat([s for s in sharded.micro_batch["input_ids"].unbind()]), -1)
    labels = torch.cat([engine.view_inputs(i, a).labels for i, a in zip(sharded.inputs, sharded.output_args)])
    assert [a["pad_size"] for a in sharded.output_args] == [1, 1] and torch.equal(labels[:7], row)
    for outputs in sharded.rank_outputs:
        for key, value in single.outputs.items():
            assert torch.allclose(outputs[key].values(), value.values(), equal_nan=True), (name, key)


def _replayed(monkeypatch, case: EngineCase, support=None):
    """``case`` run by the ``skyrl`` engine with sample-support replay on (spec/engines/skyrl/config.py), its
    recorded support the whole vocabulary or ``support(responses, vocab)``."""
    if not HAS["skyrl"]:
        pytest.skip("skyrl is not installed (spec/engines/skyrl/ci.sh)")
    if support is not None:
        monkeypatch.setattr(skyrl_config, "full_support", support)
    return execute(load_engine("skyrl"), case.with_(engine_config=(("sample_support_replay", True),)))


@pytest.mark.parametrize("packed", [False, True])
def test_sample_support_replay_over_the_whole_vocabulary_is_the_contracts(monkeypatch, packed: bool) -> None:
    """SkyRL renormalises over the recorded support: over every id that is log_softmax itself, so the outputs equal
    the oracle's, and they come back in float32 even from bf16 logits (sample_support_scores computes there)."""
    case = CASE.with_(use_remove_padding=packed)
    _assert_the_oracles(load_engine("skyrl"), case, _replayed(monkeypatch, case))
    low = _replayed(monkeypatch, case.with_(logits_dtype="bfloat16"))
    assert {v.dtype for v in low.outputs.values()} == {torch.float32}


def test_sample_support_replay_renormalises_over_the_recorded_support(monkeypatch) -> None:
    """A support of the sampled token alone: renormalised over {t}, its log-prob is log 1 = 0 and the entropy 0 at
    every response position (the switch runs SkyRL's replay, not the plain log_softmax)."""
    run = _replayed(monkeypatch, CASE, lambda responses, vocab: [np.asarray(r, dtype=np.int32)[:, None]
                                                                 for r in responses])
    for key in ("log_probs", "entropy"):
        got = run.outputs[key].unbind()
        for i, (p, r) in enumerate(zip(CASE.prompt_lens, CASE.response_lens)):
            assert got[i][p - 1:p + r - 1].abs().max() < 1e-6, (key, i, got[i])


_ROUTED = EngineCase(prompt_lens=(3, 1, 2), response_lens=(2, 1, 0), vocab=16, temperature=0.7,
                     engine_config=(("routed_experts", "int16"),))


@pytest.mark.skipif(not HAS["skyrl"], reason="skyrl is not installed (spec/engines/skyrl/ci.sh)")
@pytest.mark.parametrize("packed", [True, False])
def test_routes_are_collated_at_each_trajectorys_tokens(packed: bool, monkeypatch) -> None:
    """With routed_experts drawn, 0.4.0's batch builder collates the rollout's routes (one array per trajectory, every
    other one read-only as decoded from the wire) and INV-ROUTE-001 holds; a builder that writes each segment with
    the next trajectory's routes (a planted misalignment) fails it, by the check. A batch whose routes miss a
    trajectory is refused (routes_misaligned: INV-FLAG-004)."""
    import sys
    from spec.execute.attribution import AttributedEngine
    from spec.invariants import Ctx
    engine, case = AttributedEngine(load_engine("skyrl")), _ROUTED.with_(use_remove_padding=packed)
    preprocess = sys.modules[engine.load()[-1].__module__]  # imported with its stubs (the kit's loader)
    CATALOGUE["INV-ROUTE-001"].check(Ctx(engine, case, "cpu", case.mode))
    CATALOGUE["INV-FLAG-004"].check(Ctx(engine, case, "cpu", case.mode))
    fill = preprocess._fill_routed_expert_segment

    def next_ones(packed_, cu_seqlens, routes, index):
        fill(packed_, cu_seqlens, routes[1:] + routes[:1] if index == 0 else routes, index)
    monkeypatch.setattr(preprocess, "_fill_routed_expert_segment", next_ones)
    with pytest.raises(AssertionError, match="routed experts of sample 0"):
        CATALOGUE["INV-ROUTE-001"].check(Ctx(engine, case, "cpu", case.mode))
