"""The engine protocol and the adapters: typed capabilities, the registry, the normalized view, the
Megatron-style packing properties (reference packer passes, planted packers fail), and, where verl is
installed (the verl tox envs), every verl adapter built and probed."""

from __future__ import annotations

import importlib
import importlib.util
import itertools
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from spec.run.registry import ENGINES, builtin_engine_names, load_engine
from spec.execute.harness import execute
from spec.cases.materialize import draws, materialize
from spec.cases.structure import EngineCase, Media
from spec.invariants import CATALOGUE, Ctx
from spec.protocol.known import KnownFailure
from spec.truth.megatron_packing import PackSpec, ReferencePacker, nested_from, thd_alignment
from spec.truth.routes import rollout_routes
from spec.protocol.engine import Capabilities, EngineUnderTest, Feature, InputsView, OutputsView, ShardLayout
from spec.protocol.profile import VISION
from spec.run.runner import run_invariant, skip_reason
from spec.engines.megatron.records import vision_widths
from spec.engines.megatron import adapter as megatron

HAS_VERL = importlib.util.find_spec("verl") is not None
needs_verl = pytest.mark.skipif(not HAS_VERL, reason="verl not installed (the verl tox envs run these)")
MEGATRON = sorted(k for k in CATALOGUE if k.startswith("INV-MEG"))


class Reference(EngineUnderTest):
    name = "reference-packer"
    packer = ReferencePacker()
    layouts = tuple(ShardLayout)
    profile = replace(EngineUnderTest.profile, media=VISION)  # INV-MEG-006 runs vision-language micro-batches


def test_capabilities_are_typed_and_give_reasons() -> None:
    caps = load_engine("impl").capabilities()
    assert isinstance(caps, Capabilities) and caps.engine == "impl"
    assert Feature.SP in caps.offered and Feature.ENGINE in caps.offered
    assert caps.reason("packing") and "packing" in caps.reason(Feature.PACKING).lower()
    assert [f for f, _ in caps.table()] == [f.value for f in Feature]


def test_an_unknown_feature_is_an_error_not_an_offer() -> None:
    with pytest.raises(ValueError, match="unknown feature 'spx'"):
        load_engine("impl").lacks("spx")


def test_every_invariant_needs_only_known_features() -> None:
    for info in CATALOGUE.values():
        for need in info.needs:
            Feature.parse(need)


def test_registry_lists_every_verl_engine() -> None:
    names = builtin_engine_names()
    for name in ("impl", "verl", "verl-veomni", "verl-torchtitan", "verl-automodel", "verl-megatron"):
        assert name in names and name in ENGINES
    assert any(n.startswith("planted:zigzag") for n in names)


def test_normalized_view_of_verl_convention() -> None:
    engine = load_engine("impl")
    run = execute(engine, EngineCase(prompt_lens=(2, 1), response_lens=(1, 2), temperature=(0.5, 2.0)))
    view = engine.view_inputs(run.inputs[0], run.output_args[0])
    assert isinstance(view, InputsView) and view.attention_mask is None
    assert view.labels.tolist() == torch.roll(run.micro_batch["input_ids"].values(), -1).tolist()
    assert view.temperature.tolist() == [0.5, 0.5, 0.5, 2.0, 2.0, 2.0]


@pytest.mark.parametrize("invariant", MEGATRON)
def test_reference_packer_passes(invariant: str) -> None:
    """impl ships no packer, so tests/test_invariants.py skips INV-MEG-* on impl: here they run at ``ci`` size
    against the suite's reference packer, and each exercises its property on >= 90% of its examples (the share
    tests/test_exercised.py asks of every invariant it can run on impl)."""
    outcome = run_invariant(CATALOGUE[invariant], Reference(), "any", profile="ci")
    assert outcome.status == "pass", f"{outcome.counterexample}: {outcome.error}"
    assert outcome.examples >= 100 and outcome.exercised >= 0.9 * outcome.examples, (
        f"{invariant} exercised its property on {outcome.exercised} of {outcome.examples} examples")


def test_alignment_rule() -> None:
    assert thd_alignment(PackSpec(tp=2, cp=2, layout=ShardLayout.ZIGZAG)) == (8, 2)
    assert thd_alignment(PackSpec(tp=2, cp=2, layout=ShardLayout.CONTIGUOUS)) == (4, 2)
    assert thd_alignment(PackSpec(tp=1, cp=2, fp8=True)) == (16, 512)
    assert thd_alignment(PackSpec(tp=1, cp=2, bucket=7)) == (4, 28)


def test_reference_zigzag_by_hand() -> None:
    """One sequence of 8 tokens, CP = 2 zig-zag: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2."""
    x = nested_from([torch.arange(10, 18)])
    spec = PackSpec(tp=1, cp=2, layout=ShardLayout.ZIGZAG)
    ranks = [ReferencePacker().pack_thd(x, spec, r) for r in range(2)]
    assert ranks[0].rows.tolist() == [[10, 11, 16, 17]] and ranks[1].rows.tolist() == [[12, 13, 14, 15]]
    assert ranks[0].positions.tolist() == [[0, 1, 6, 7]]


@pytest.mark.parametrize("layout", list(ShardLayout))
def test_reference_contiguous_and_labels_by_hand(layout: ShardLayout) -> None:
    x = nested_from([torch.tensor([5, 6, 7]), torch.tensor([8])])
    spec = PackSpec(tp=1, cp=2, layout=layout)
    shards = [ReferencePacker().pack_thd(x, spec, r, need_roll=True) for r in range(2)]
    labels = ReferencePacker().unpack_thd(shards, x, spec)
    assert [t.tolist() for t in labels.unbind()] == [[6, 7, 5], [8]]


# -- verl's adapters (the verl envs) --------------------------------------------------------------------
@needs_verl
@pytest.mark.parametrize("name", ["verl-veomni", "verl-torchtitan", "verl-automodel"])
def test_verl_engine_adapters_run_a_case_and_report_stubs(name: str) -> None:
    engine = load_engine(name)
    assert engine.stubs.real or engine.stubs.stubbed
    for packed in (True, False):
        case = EngineCase(prompt_lens=(3, 2), response_lens=(2, 1), use_remove_padding=packed, calculate_entropy=True)
        run = execute(engine, case)
        view = engine.view_inputs(run.inputs[0], run.output_args[0])
        assert view.labels is not None and view.labels.reshape(-1)[0] == run.micro_batch["input_ids"].values()[1]
        assert (view.attention_mask is None) == packed
        assert [t.shape[0] for t in run.outputs["log_probs"].unbind()] == [5, 3]


@needs_verl
@pytest.mark.parametrize("name", ["verl-torchtitan", "verl-automodel"])
def test_native_verl_engines_hand_the_model_the_samples_media(name: str) -> None:
    """Both native engines call extract_multi_modal_inputs on every micro-batch: the adapter's engine object hands the
    model its keys (TorchTitan's extra_inputs, Automodel's model_inputs) and the view reads them, in both modes."""
    engine = load_engine(name)
    assert engine.profile.media and "verl.utils.model:extract_multi_modal_inputs" in engine.profile.surface
    case = EngineCase(prompt_lens=(5, 2), response_lens=(2, 1), vocab=16, mrope=True, seed=4,
                      media=((Media("image", 1, 2, 4, 1),), (Media("video", 2, 2, 2, 0),)))
    want = draws(case).media_inputs()
    for packed in (True, False):
        run = execute(engine, case.with_(use_remove_padding=packed))
        view = engine.view_inputs(run.inputs[0], run.output_args[0])
        assert set(view.media) == set(want), (packed, sorted(view.media))
        for key, value in want.items():
            assert torch.equal(view.media[key], value) and torch.equal(run.inputs[0][key], value), (packed, key)


_ROUTED = EngineCase(prompt_lens=(3, 1, 2), response_lens=(2, 1, 0), vocab=16, temperature=0.7,
                     engine_config=(("routed_experts", "int16"),))


@needs_verl
def test_veomni_hands_the_masks_its_vl_models_place_features_at(monkeypatch) -> None:
    """VeOmni's VL models place the image and video features at the image_mask / video_mask its input transform hands
    (its profile's media_marks): INV-MM-001 holds, and a transform that hands no video_mask fails it, by the check,
    naming the key (a text-only model type hands none: no media, nothing to place)."""
    engine = load_engine("verl-veomni")
    assert engine.profile.media_marks == ("image_mask", "video_mask")
    case = EngineCase(prompt_lens=(5, 2), response_lens=(2, 1), vocab=16, mrope=True, seed=4,
                      media=((Media("image", 1, 2, 4, 1),), (Media("video", 2, 2, 2, 0),)))
    CATALOGUE["INV-MM-001"].check(Ctx(engine, case, "cpu", case.mode))
    cls = engine.stubs.module.VeOmniEngine
    transform = cls._apply_veomni_input_transforms

    def no_video_mask(self, model_inputs, micro_batch):
        transform(self, model_inputs, micro_batch)
        model_inputs.pop("video_mask", None)
    monkeypatch.setattr(cls, "_apply_veomni_input_transforms", no_video_mask)
    with pytest.raises(AssertionError, match="handed no 'video_mask'"):
        CATALOGUE["INV-MM-001"].check(Ctx(engine, case, "cpu", case.mode))


@needs_verl
@pytest.mark.parametrize("bucket", [None, 4])
def test_veomni_replays_the_rollouts_routes_at_each_samples_tokens(bucket, monkeypatch) -> None:
    """With routed_experts drawn (R3), VeOmni's engine arms its controller with the micro-batch's routes, the stand-in
    MoE routers fire through VeOmni's hook, and INV-ROUTE-001 holds (the pad bucket's zero rows routed natively; every
    router fired: prepare_model_outputs' own check). An engine that hands the targets one token late, or hands zero
    targets (routes never copied: the routers route natively, as the rollout did not), fails it, by the check."""
    engine = load_engine("verl-veomni")
    if engine.lacks("routes"):
        pytest.skip(engine.lacks("routes"))
    case = _ROUTED.with_(pad_to_length=bucket)
    run = execute(engine, case)  # the model and prepare_model_outputs too: every router fired
    assert [t.shape[0] for t in run.outputs["log_probs"].unbind()] == [5, 2, 2]
    CATALOGUE["INV-ROUTE-001"].check(Ctx(engine, case, "cpu", case.mode))
    cls = engine._classes["lm"]
    arm = cls._prepare_router_replay_inputs
    for wrong, match in ((lambda v: v.roll(1, 0), "routed experts of sample 0 at token 0"),
                         (torch.zeros_like, "routed experts of sample 0 at token 0")):
        def planted(self, micro_batch, output_args, wrong=wrong):
            bad = micro_batch.copy()
            routes = micro_batch["routed_experts"]
            bad["routed_experts"] = torch.nested.nested_tensor_from_jagged(wrong(routes.values()), routes.offsets())
            return arm(self, bad, output_args)
        monkeypatch.setattr(cls, "_prepare_router_replay_inputs", planted)
        with pytest.raises(AssertionError, match=match):
            CATALOGUE["INV-ROUTE-001"].check(Ctx(engine, case, "cpu", case.mode))
    assert skip_reason(CATALOGUE["INV-ROUTE-001"], engine, "cpu", "padded") == (
        "the engine replays routed experts in the packed mode only (its profile: routes_modes=('packed',)); no "
        "padded run with routes")


@needs_verl
@pytest.mark.parametrize("bucket", [None, 4])
def test_veomni_records_each_samples_routes_under_r2(bucket, monkeypatch) -> None:
    """With routed_experts drawn to ``record`` (R2's compute_log_prob), VeOmni's engine arms its controller in RECORD,
    the stand-in routers' own routes are recorded and prepare_model_outputs returns them per sample (the pad suffix
    dropped), and INV-ROUTE-002 holds; a record whose pad suffix is cut from the head, or rolled by one token, fails it,
    by the check."""
    engine = load_engine("verl-veomni")
    if engine.lacks("routes_record"):
        pytest.skip(engine.lacks("routes_record"))
    case = _ROUTED.with_(pad_to_length=bucket, engine_config=(("routed_experts", "record"),))
    run = execute(engine, case)
    assert "routed_experts" not in run.outputs and [t.shape[0] for t in run.rank_routes[0]] == [5, 2, 2]
    CATALOGUE["INV-ROUTE-002"].check(Ctx(engine, case, "cpu", case.mode))
    take = engine.stubs.module.VeOmniRouterReplay.take_recorded
    for wrong in ((lambda v: v.roll(-int(bucket or 1), 0)), (lambda v: v.roll(1, 0))):
        monkeypatch.setattr(engine.stubs.module.VeOmniRouterReplay, "take_recorded",
                            lambda self, wrong=wrong: wrong(take(self)))
        with pytest.raises(AssertionError, match="recorded routes of sample 0 at token 0"):
            CATALOGUE["INV-ROUTE-002"].check(Ctx(engine, case, "cpu", case.mode))


@needs_verl
def test_verl_torchtitan_capabilities_are_probed() -> None:
    caps = load_engine("verl-torchtitan").capabilities()
    assert {Feature.VALUE, Feature.DISTILLATION, Feature.BUCKET, Feature.FUSED, Feature.SP} <= set(caps.missing)
    assert Feature.ENGINE in caps.offered and Feature.CHUNKING in caps.offered


@needs_verl
def test_verl_megatron_packer_agrees_with_the_reference() -> None:
    engine = load_engine("verl-megatron")
    assert engine.lacks(Feature.PACKING) is None and engine.lacks(Feature.ENGINE) is None
    x = nested_from([torch.arange(1, 4), torch.arange(10, 15), torch.tensor([20])])
    for tp, cp in ((1, 1), (2, 1), (1, 2), (2, 4)):
        spec = PackSpec(tp=tp, cp=cp, layout=ShardLayout.ZIGZAG)
        for rank in range(cp):
            ours, verl = ReferencePacker().pack_thd(x, spec, rank), engine.packer.pack_thd(x, spec, rank)
            valid = ours.rows != 0  # x has no zeros: the valid rows (pad positions are no one's contract)
            assert torch.equal(ours.rows, verl.rows) and torch.equal(ours.positions[valid], verl.positions[valid])
            assert torch.equal(ours.cu_seqlens_padded, verl.cu_seqlens_padded.to(ours.cu_seqlens_padded.dtype))


@needs_verl
def test_verl_megatron_mtp_targets_agree_with_the_reference_and_a_planted_mask_fails() -> None:
    """gptmodel_forward_model_engine(mtp_enable_train=True) hands an MTP model, on every rank, the targets the
    reference packer states (the labels rolled within each sequence, the loss mask aligned to the ids and rolled
    likewise; THD the positions and the step's factor), the loss mask handed nested or padded beside its attention
    mask; INV-MEG-008 passes on verl's and fails on a packer that does not roll the mask."""
    engine = load_engine("verl-megatron")
    x = nested_from([torch.arange(1, 6), torch.arange(10, 14), torch.tensor([20, 21])]).double()
    response = nested_from([torch.tensor([True, False, True]), torch.tensor([True]), torch.tensor([], dtype=torch.bool)])
    reference = ReferencePacker()
    # a sequence's last token has no next token: its label is anything (verl's THD roll without CP takes the next
    # sequence's first); its loss mask must be 0
    inner = nested_from([torch.cat([torch.ones(n - 1), torch.zeros(1)]) for n in (5, 4, 2)])
    for tp, cp, packed, dense in ((1, 1, True, False), (2, 2, True, True), (1, 4, True, False), (2, 2, False, True)):
        spec = PackSpec(tp=tp, cp=cp, layout=ShardLayout.ZIGZAG)
        for rank in range(cp):
            ours = reference.mtp_targets(x, response, spec, rank, packed=packed, factor=0.5)
            verl = engine.packer.mtp_targets(x, response, spec, rank, packed=packed, factor=0.5, dense_mask=dense)
            valid = (reference.pack_thd(x, spec, rank).rows if packed else reference.pack_bshd(x, spec, rank)[0]) != 0
            within = (reference.pack_thd(inner, spec, rank).rows if packed else
                      reference.pack_bshd(inner, spec, rank)[0]) != 0
            assert torch.equal(verl.labels.double()[within], ours.labels.double()[within]), (spec, rank)
            assert torch.equal(verl.loss_mask.double(), ours.loss_mask.double()), (spec, rank)  # padding 0
            if packed:
                assert torch.equal(verl.positions[valid], ours.positions[valid]) and verl.factor == 0.5
    case = EngineCase(prompt_lens=(3, 2, 1), response_lens=(2, 2, 0), seed=7)
    CATALOGUE["INV-MEG-008"].check(Ctx(engine, case, "cpu", "any"))
    planted = load_engine("planted:mtp_mask_unrolled")
    with pytest.raises(AssertionError, match="MTP loss mask"):
        CATALOGUE["INV-MEG-008"].check(Ctx(planted, case, "cpu", "any"))


@needs_verl
def test_verl_megatron_router_replay_agrees_with_the_reference_and_planted_replays_fail() -> None:
    """verl's forward_step hands each TP rank of each CP rank the routes (and R3's replay mask) the reference packer
    states on every token row (padding rows aside), R2's record merges every rank's routes back to the tokens,
    under fixed and dynamic CP and FP8; INV-MEG-009 passes on verl's and fails on packers that pack the routes
    unaligned, replay only the response, or gather the TP ranks' records in reverse."""
    engine = load_engine("verl-megatron")
    case = EngineCase(prompt_lens=(3, 2, 1), response_lens=(2, 3, 0), seed=7)
    micro_batch = materialize(case)
    lens = micro_batch["input_ids"].offsets().diff().tolist()
    gen = torch.Generator().manual_seed(0)
    routes = nested_from([torch.randint(0, 64, (n, 2, 2), generator=gen).to(torch.int16) for n in lens])
    rollout = nested_from([r[:-1] if i == 1 else r for i, r in enumerate(routes.unbind())])  # one missing last route
    reference = ReferencePacker()
    for spec in (PackSpec(1, 1), PackSpec(2, 2), PackSpec(1, 4, fp8=True), PackSpec(2, 2, dynamic=True)):
        ones = nested_from([torch.ones(n) for n in lens])
        for mode, given in (("R2", routes), ("R3", rollout)):
            batch = micro_batch.copy()
            batch["routed_experts"] = given
            for rank in range(spec.cp):
                valid = reference.pack_thd(ones, spec, rank).rows[0] != 0
                ours = reference.replayed_routes(batch, spec, rank, mode=mode)
                verl = engine.packer.replayed_routes(batch, spec, rank, mode=mode)
                assert len(verl.routes) == spec.tp, (spec, mode)
                got, want = torch.cat(verl.routes), torch.cat(ours.routes)
                assert torch.equal(got[valid].long(), want[valid].long()), (spec, mode, rank)
                if mode == "R2":
                    assert all(m is None for m in verl.masks), (spec, rank)
                else:
                    assert torch.equal(torch.cat(verl.masks)[valid], torch.cat(ours.masks)[valid]), (spec, rank)
        recorded = [list(reference.pack_thd(routes, spec, rank).rows[0].chunk(spec.tp)) for rank in range(spec.cp)]
        merged = engine.packer.recorded_routes(micro_batch, recorded, spec)
        assert all(torch.equal(a.long(), b.long()) for a, b in zip(merged.unbind(), routes.unbind())), spec
    CATALOGUE["INV-MEG-009"].check(Ctx(engine, case, "cpu", "any"))
    for bug, match in (("routes_packed_unaligned", "replays route"), ("replay_mask_response_only", "replays rows"),
                       ("record_tp_parts_reversed", "recorded routes")):
        planted = load_engine(f"planted:{bug}")
        with pytest.raises(AssertionError, match=match):
            for seed in range(8):  # the quiet one shows under TP > 1 only: a spec the seed picks
                CATALOGUE["INV-MEG-009"].check(Ctx(planted, replace(case, seed=seed), "cpu", "any"))


@needs_verl
def test_verl_megatron_r3_replay_on_the_engine_object_and_f28_in_bshd() -> None:
    """The engine object with R3 router replay (the routes switch): THD, every token a counted log-prob reads replays
    the rollout's route (INV-ROUTE-001); BSHD (F28, run by hand: the profile runs THD only): forward_step packs the
    routes THD while the model's routers read (S, B) rows, so equal-length samples silently replay other tokens'
    routes and other batches raise. Fails once verl packs BSHD routes in the model's row order."""
    engine = load_engine("verl-megatron")
    assert engine.profile.routes_modes == ("packed",) and "F28" in engine.profile.routes_note
    for mode, packed in (("packed", True), ("padded", False)):
        case = EngineCase(prompt_lens=(1, 2), response_lens=(1, 1), use_remove_padding=packed, mask_hole_rate=0.0,
                          engine_config=(("routed_experts", "int16"),), seed=0)  # two samples of 2 and 3 tokens
        if packed:
            CATALOGUE["INV-ROUTE-001"].check(Ctx(engine, case, "cpu", mode))
    replay = megatron.EngineReplay("int16", bshd=True)
    obj = megatron.MegatronEngineObject(engine.packer._rank, replay=replay)
    for lens, raises in (((2, 2), False), ((2, 3), True)):
        case = EngineCase(prompt_lens=(1, lens[1] - 1), response_lens=(1, 1), use_remove_padding=False,
                          mask_hole_rate=0.0, engine_config=(("routed_experts", "int16"),), seed=0)
        micro_batch = materialize(case)
        if raises:
            with pytest.raises(RuntimeError, match="Router replay tensors are not aligned"):
                obj.prepare_model_inputs(micro_batch)
            continue
        _, output_args = obj.prepare_model_inputs(micro_batch)
        ids = micro_batch["input_ids"].unbind()
        first = [bool(torch.equal(got[0].long(), rollout_routes(seq, "int16")[0].long()))
                 for got, seq in zip(output_args["routes"], ids)]
        assert first == [True, False], first  # sample 1's first token replays sample 0's second token's route


@needs_verl
def test_verl_megatron_dynamic_cp_splits_as_fixed_cp(monkeypatch) -> None:
    """Dynamic CP (local_cp_size: the CP group taken per micro-batch) packs every rank's shard as fixed CP does, and
    re-assembles them (verl's own branches, the group and rank from the fake parallel state); a packer that reads its
    rank from the fixed CP group instead (rank 0 everywhere) fails INV-MEG-001 under a dynamic spec, by the check."""
    engine = load_engine("verl-megatron")
    x = nested_from([torch.arange(1, 4), torch.arange(10, 15), torch.tensor([20])])
    for tp, cp in ((1, 2), (2, 4)):
        fixed, dynamic = PackSpec(tp=tp, cp=cp), PackSpec(tp=tp, cp=cp, dynamic=True)
        shards = [engine.packer.pack_thd(x, dynamic, rank) for rank in range(cp)]
        for rank, shard in enumerate(shards):
            assert torch.equal(shard.rows, engine.packer.pack_thd(x, fixed, rank).rows), (tp, cp, rank)
            assert shard.state.local_cp_size == cp
        assert all(torch.equal(a, b) for a, b in zip(engine.packer.unpack_thd(shards, x, dynamic).unbind(),
                                                     x.unbind()))
    case = EngineCase(prompt_lens=(3, 2), response_lens=(2, 1), seed=0)
    CATALOGUE["INV-MEG-001"].check(Ctx(engine, case, "cpu", "any"))
    real = megatron.fake_parallel_state
    monkeypatch.setattr(megatron, "fake_parallel_state", lambda spec, rank: real(spec, 0 if spec.dynamic else rank))
    with pytest.raises(AssertionError, match="dynamic CP"):
        CATALOGUE["INV-MEG-001"].check(Ctx(engine, case, "cpu", "any"))


@needs_verl
def test_verl_megatron_vision_forward_agrees_with_the_reference() -> None:
    """Megatron's forward_step, run up to the model call on a vision-language micro-batch (an image, a text-only
    sample, a video), hands the model what the reference states: the rows and mask, the samples' media in sample
    order and (THD) the labels' boundaries; and under FP8 its BSHD rows differ from the labels' width exactly where
    the record's arithmetic says (spec/engines/megatron/records.py)."""
    engine = load_engine("verl-megatron")
    case = EngineCase(prompt_lens=(5, 2, 7), response_lens=(2, 1, 3), vocab=16, mrope=True, seed=4,
                      media=((Media("image", 1, 2, 4, 1),), (), (Media("video", 2, 2, 2, 0),)))
    micro_batch = materialize(case)
    for (tp, cp), packed in itertools.product(((1, 1), (2, 1), (1, 2), (2, 4)), (True, False)):
        spec = PackSpec(tp=tp, cp=cp, layout=ShardLayout.ZIGZAG)
        for rank in range(cp):
            verl = engine.packer.vlm_inputs(micro_batch, spec, rank, packed=packed)
            ours = ReferencePacker().vlm_inputs(micro_batch, spec, rank, packed=packed)
            assert set(verl) - {"position_ids"} == set(ours), (spec, packed, sorted(verl))
            for key, value in ours.items():
                assert torch.equal(verl[key].long(), value.long()), (spec, packed, rank, key)
    lens = case.seq_lens
    for tp, cp in ((1, 1), (2, 2), (4, 1)):
        spec = PackSpec(tp=tp, cp=cp, layout=ShardLayout.ZIGZAG, fp8=True)
        rows = engine.packer.vlm_inputs(micro_batch, spec, 0, packed=False)["input_ids"].shape[1]
        labels = engine.packer.pack_bshd(micro_batch["input_ids"], spec, 0)[1].shape[1] * cp
        assert (rows, labels) == vision_widths(lens, tp, cp), (tp, cp)


@needs_verl
def test_verl_megatron_runs_the_layer_checks_bridged_to_step_layers() -> None:
    """verl-megatron has verl's micro-batch layer and an engine object on one rank: the micro-batch checks that also run
    through a step layer (INV-MB-001/006/007/008, which drop the ``microbatch`` need) run its layer; the value checks
    run the engine object; a check that needs sequence parallelism skips with the engine's reason."""
    engine = load_engine("verl-megatron")
    for inv in ("INV-MB-001", "INV-MB-006", "INV-MB-007", "INV-MB-008"):
        assert "microbatch" not in CATALOGUE[inv].needs and skip_reason(CATALOGUE[inv], engine, "cpu") is None, inv
    assert skip_reason(CATALOGUE["INV-VAL-001"], engine, "cpu", "packed") is None
    assert skip_reason(CATALOGUE["INV-SP-001"], engine, "cpu", "packed") == engine.lacks(Feature.SP)


@needs_verl
@pytest.mark.parametrize("packed", [True, False])
def test_verl_megatron_engine_object_runs_forward_step_to_the_oracle(packed: bool) -> None:
    """Megatron's forward_step, run whole on one rank (spec/engines/megatron/engine.py), returns the oracle's log-probs,
    entropy, top-K terms and values on a text micro-batch and on a vision-language one (an image beside a text-only
    sample, mRoPE positions), THD and BSHD; the view states the packed row the model attends and the labels the
    logits processor scores (each sample's next id inside it)."""
    from spec.cases.materialize import draws
    from spec.execute.harness import model_for
    from spec.truth.oracle import expected

    engine = load_engine("verl-megatron")
    cases = [EngineCase(prompt_lens=(5, 2), response_lens=(2, 1), vocab=16, calculate_entropy=True, topk=2,
                        distillation_keys=("distillation_losses", "student_mass")),
             EngineCase(prompt_lens=(5, 2), response_lens=(2, 1), vocab=16, mrope=True, seed=4,
                        media=((Media("image", 1, 2, 4, 1),), ())),
             EngineCase(prompt_lens=(3, 4), response_lens=(1, 2), vocab=16, head="value")]
    for case in cases:
        case = replace(case, use_remove_padding=packed)
        run = execute(engine, case)
        want = expected(case, model_for(case, "cpu", engine), draws(case))
        for key, got in run.outputs.items():
            if key in ("overlap_count", "overlap_token_advantage", "teacher_mass"):
                continue
            for i, (g, w) in enumerate(zip(got.unbind(), want.of(key))):
                n = len(w)  # (each sequence's last position scores no token of its own)
                assert torch.allclose(g[:n].double(), w.double(), atol=1e-4), (case, key, i)
        view = engine.view_inputs(run.inputs[0], run.output_args[0])
        ids = run.micro_batch["input_ids"]
        assert (view.attention_mask is None) == packed
        if case.head == "lm":
            starts = ids.offsets()[:-1]
            assert torch.equal(view.labels[starts], ids.values()[starts + 1]), case
        if packed:
            assert view.cu_seqlens.tolist() == ids.offsets().tolist() and torch.equal(view.input_ids[0], ids.values())
@pytest.mark.parametrize("module, attr", [("spec.engines.torchtitan.adapter", "KNOWN_RECORDS"),
                                          ("spec.engines.automodel.adapter", "KNOWN_RECORDS"),
                                          ("spec.engines.megatron.adapter", "MegatronEngine"),
                                          ("spec.engines.megatron.records", "VISION_RECORDS"),
                                          ("spec.engines.megatron.records", "MEGATRON_ENGINE_RECORDS")])
def test_every_engine_known_failure_is_a_precise_documented_record(module: str, attr: str) -> None:
    """Each adapter's known failures are KnownFailure records (no legacy dict): an invariant of the catalogue, a
    condition, an exception type and a message pattern, and a mention in its page (spec/engines/<folder>/README.md)."""
    obj = getattr(importlib.import_module(module), attr)
    records = obj.KNOWN if isinstance(obj, type) else obj
    page = Path(importlib.import_module(module).__file__).parent / "README.md"
    doc = page.read_text()
    assert records and all(isinstance(r, KnownFailure) for r in records), records
    for record in records:
        assert record.invariant in CATALOGUE, record.key
        assert record.when.text and record.matches and "legacy" not in record.when.text, record.key
        assert record.invariant in doc, f"{record.key} is not in {page}"


@needs_verl
def test_the_inheriting_engines_run_the_preparation_checked_here() -> None:
    """FSDP-Turbo and MindSpeed ship no preparation of their own: their prepare/forward methods are FSDP's and
    Megatron's (so --engine verl and --engine verl-megatron check theirs). Fails once either overrides one."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from verl.workers.engine.fsdp.fsdp_turbo_impl import FSDPTurboEngineWithLMHead as Turbo
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead as Fsdp
        pairs = [(Turbo, Fsdp, ("prepare_model_inputs", "prepare_model_outputs"))]
        try:
            from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead as Megatron
            from verl.workers.engine.mindspeed.transformer_impl import MindspeedEngineWithLMHead as MindSpeed
        except ImportError as exc:  # megatron-core absent: the FSDP pair alone
            print(f"MindSpeed not checked: {exc}")
        else:
            pairs.append((MindSpeed, Megatron, ("prepare_model_inputs", "prepare_model_outputs", "forward_step")))
    for child, parent, methods in pairs:
        for method in methods:
            assert getattr(child, method) is getattr(parent, method), f"{child.__name__}.{method} is its own"


class _RenamedOutputs:
    """impl's engine object, returning ``logprobs`` where the contract says ``log_probs``."""

    def __init__(self, inner):
        self.inner = inner

    def prepare_model_inputs(self, micro_batch):
        return self.inner.prepare_model_inputs(micro_batch)

    def prepare_model_outputs(self, *args, **kwargs):
        out = self.inner.prepare_model_outputs(*args, **kwargs)
        return {("logprobs" if k == "log_probs" else k): v for k, v in out.items()}


class _Renaming(EngineUnderTest):
    name = "renaming"

    def make(self, head="lm", **settings):
        return _RenamedOutputs(load_engine("impl").make(head, **settings))


class _RenamingMapped(_Renaming):
    name = "renaming-mapped"

    def view_outputs(self, outputs):
        return OutputsView({("log_probs" if k == "logprobs" else k): v for k, v in outputs.items()})


def test_invariants_read_outputs_through_the_engines_view() -> None:
    """An engine with its own output names fails the catalogue until its adapter maps them in view_outputs."""
    info = CATALOGUE["INV-VAL-001"]
    unmapped = run_invariant(info, _Renaming(), "packed", profile="dev", max_examples=5)
    assert unmapped.status != "pass" and "log_probs" in (unmapped.error or ""), unmapped.error
    keys = run_invariant(CATALOGUE["INV-KEYS-001"], _Renaming(), "packed", profile="dev", max_examples=5)
    assert keys.status == "fail" and "logprobs" in keys.error, keys.error  # the key-set check names it
    outcome = run_invariant(info, _RenamingMapped(), "packed", profile="dev", max_examples=5)
    assert outcome.status == "pass", outcome.error
