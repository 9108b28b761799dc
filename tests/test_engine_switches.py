"""Each third-party engine's own configuration switches (spec/engines/trl/config.py, spec/engines/openrlhf/config.py): declared in
its ``config_space``, each reaches the library's code path it names, and the outputs a consumer reads are the same
with it on as off. Where the library is installed (its CI step); the declarations everywhere."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from spec.cases import EngineCase
from spec.cases.materialize import materialize
from spec.cases.structure import Media
from spec.engines.openrlhf.media import vlm_args
from spec.engines.openrlhf.config import GATHERED_LOGITS
from spec.execute.harness import execute
from spec.invariants import Ctx
from spec.run.registry import load_engine

HAS = {"trl": importlib.util.find_spec("trl") is not None, "openrlhf": importlib.util.find_spec("openrlhf") is not None}
CASE = EngineCase(prompt_lens=(3, 2, 1), response_lens=(2, 3, 1), vocab=9, temperature=0.5, calculate_entropy=True)


@pytest.mark.parametrize("name, switches", [
    ("trl", {"pad_to_multiple_of", "prepacked", "sft_collator", "return_position_ids", "entropy_requires_grad",
             "row_mask", "model_takes_logits_to_keep", "index_k"}),
    ("trl-fused", {"pad_to_multiple_of", "prepacked", "sft_collator", "return_position_ids", "cast_lm_head_to_fp32",
                   "compute_loss_func", "shift_labels", "logit_scaling", "moe_router", "score_chunk",
                   "vision_family"}),
    ("openrlhf", {"action_mask", "stack", "return_logprobs", "allgather_logits", "video_token_id"})])
def test_switches_are_declared(name, switches) -> None:
    assert {switch.name for switch in load_engine(name).config_space()} == switches


@pytest.mark.parametrize("videos", [False, True])
def test_openrlhf_images_only_config_names_no_video_token(videos: bool) -> None:
    """video_token_id drawn off: the VLM config OpenRLHF's actor reads (``_vlm_config``) names no video token id, as an
    images-only model's (Gemma 3's); a micro-batch with videos keeps it (such a model is never handed one)."""
    media = ((Media("image", 1, 2, 4, 1),), (Media("video", 2, 2, 2, 0),) if videos else ())
    case = EngineCase(prompt_lens=(9, 9), response_lens=(2, 3), vocab=64, temperature=1.0, mrope=True,
                      use_remove_padding=False, media=media)
    mb = materialize(case, "cpu")
    positions = list(mb["position_ids"].unbind())
    on, off = (vlm_args(mb, positions, False, {"video_token_id": v})["vlm_config"] for v in (True, False))
    assert vars(on) == {"image_token_id": vars(on)["image_token_id"], "video_token_id": vars(on)["video_token_id"]}
    assert vars(off) == (vars(on) if videos else {"image_token_id": vars(on)["image_token_id"]})


def _read(engine, case, at: list) -> dict[str, list[float]]:
    """Each output of ``case``'s run at the positions ``at`` of each sequence."""
    return {key: torch.cat([seq[where] for seq, where in zip(value.unbind(), at)]).tolist()
            for key, value in execute(engine, case).outputs.items()}


def _same_as_off(name: str, config: tuple, packed: bool) -> None:
    """With the switch on, the outputs at the positions a consumer reads (the engine's span with it on) are those
    of the run with it off."""
    engine = load_engine(name)
    on, off = CASE.with_(use_remove_padding=packed, engine_config=config), CASE.with_(use_remove_padding=packed)
    at = Ctx(engine, on, "cpu", on.mode).read
    got, want = _read(engine, on, at), _read(engine, off, at)
    assert got.keys() == want.keys()
    for key in want:
        assert torch.allclose(torch.tensor(got[key]), torch.tensor(want[key]), atol=1e-5), (key, config)


@pytest.mark.skipif(not HAS["trl"], reason="trl is not installed (spec/engines/trl/ci.sh)")
@pytest.mark.parametrize("name, config, packed", [
    ("trl", (("pad_to_multiple_of", 8),), True), ("trl", (("prepacked", True),), True),
    ("trl", (("model_takes_logits_to_keep", True),), False), ("trl", (("index_k", 2),), False),
    ("trl", (("entropy_requires_grad", False),), True), ("trl", (("row_mask", False),), True),
    ("trl", (("sft_collator", True),), False), ("trl", (("sft_collator", True), ("return_position_ids", True)), False),
    ("trl", (("sft_collator", True), ("row_mask", False)), False),
    ("trl-fused", (("cast_lm_head_to_fp32", True),), True), ("trl-fused", (("pad_to_multiple_of", 8),), True),
    ("trl-fused", (("sft_collator", True),), False), ("trl-fused", (("shift_labels", True),), True),
    ("trl-fused", (("sft_collator", True), ("shift_labels", True)), False),
    ("trl-fused", (("compute_loss_func", True),), True), ("trl-fused", (("logit_scaling", "logit_scale"),), True),
    ("trl-fused", (("logit_scaling", "logits_scaling"),), False),
    ("trl-fused", (("logit_scaling", "logit_scale"), ("compute_loss_func", True)), True),
    ("trl-fused", (("moe_router", True),), True), ("trl-fused", (("moe_router", True),), False),
    ("trl-fused", (("moe_router", True), ("sft_collator", True)), False)])
def test_trl_switches_change_the_path_not_the_outputs(name, config, packed) -> None:
    _same_as_off(name, config, packed)


@pytest.mark.skipif(not HAS["trl"], reason="trl is not installed (spec/engines/trl/ci.sh)")
def test_trl_text_samples_of_a_vision_batch_are_sfts_rows() -> None:
    """With sft_collator drawn, the text-only samples of a vision-language batch run alone (their multi_modal_inputs
    all empty, as INV-BATCH-002's sub-batch hands them) are SFT's rows, as the case says (config.sft_rows): each
    response token's log-prob is the whole batch's. Before, the adapter read the empty stack as a vision batch and laid
    the rows out as GRPO's while the harness expected SFT's: NaN log-probs (ci's INV-BATCH-002/padded, found when
    trl-fused drew moe_router)."""
    from spec.cases.materialize import select_rows
    from spec.cases.structure import Media

    engine = load_engine("trl-fused")  # (trl draws no images)
    case = EngineCase(prompt_lens=(2, 1, 3), response_lens=(1, 1, 1), vocab=8, temperature=0.5, mrope=True,
                      use_remove_padding=False, engine_config=(("sft_collator", True),), media=((Media(),), (), ()))
    whole = execute(engine, case)
    part = execute(engine, case.subset([1, 2]), micro_batch=select_rows(whole.micro_batch, [1, 2]))
    at = Ctx(engine, case, "cpu", case.mode).read
    for i, row in enumerate((1, 2)):
        got = part.outputs["log_probs"].unbind()[i][at[row]]
        want = whole.outputs["log_probs"].unbind()[row][at[row]]
        assert torch.allclose(got, want, atol=1e-5), (row, got, want)


@pytest.mark.skipif(not HAS["trl"], reason="trl is not installed (spec/engines/trl/ci.sh)")
@pytest.mark.parametrize("packed", [True, False])
def test_trl_fused_moe_router_adds_the_load_balancing_loss(packed, monkeypatch) -> None:
    """With moe_router drawn the fused forward asks the backbone for its router logits and returns the load-balancing
    loss (GRPO asks for it, padded: finite, the router reading the padding's poisoned hidden states as 0): the
    MoE path is taken, not only declared."""
    from trl.trainer import grpo_trainer

    losses = []
    original = grpo_trainer.GRPOTrainer._get_per_token_logps_and_entropies.__wrapped__

    def recording(*args, **kwargs):
        out = original(*args, **kwargs)
        losses.append(out[2])
        return out

    if not packed:
        monkeypatch.setattr(grpo_trainer.GRPOTrainer._get_per_token_logps_and_entropies, "__wrapped__", recording)
    case = CASE.with_(use_remove_padding=packed, engine_config=(("moe_router", True),))
    execute(load_engine("trl-fused"), case)
    assert packed or (losses and all(loss is not None and torch.isfinite(loss) for loss in losses)), losses


@pytest.mark.skipif(not HAS["trl"], reason="trl is not installed (spec/engines/trl/ci.sh)")
@pytest.mark.parametrize("scaling", ["logit_scale", "logits_scaling"])
def test_trl_fused_logit_scaling_is_read_off_the_config(scaling, monkeypatch) -> None:
    """The scaled stand-in's logits are the harness's only through the scale TRL reads off the config: with the
    attribute renamed to one TRL does not read (the weight still handed times 16), the log-probs differ."""
    from spec.engines.trl import families

    engine, packed = load_engine("trl-fused"), scaling == "logit_scale"
    on = CASE.with_(use_remove_padding=packed, engine_config=(("logit_scaling", scaling),))
    off = CASE.with_(use_remove_padding=packed)
    at = Ctx(engine, on, "cpu", on.mode).read
    _, value, scale = families.LOGIT_SCALINGS[scaling]
    monkeypatch.setitem(families.LOGIT_SCALINGS, scaling, ("unread_scale", value, scale))
    got, want = _read(engine, on, at), _read(engine, off, at)
    assert not torch.allclose(torch.tensor(got["log_probs"]), torch.tensor(want["log_probs"]), atol=1e-3)


@pytest.mark.skipif(not HAS["trl"], reason="trl is not installed (spec/engines/trl/ci.sh)")
def test_trl_padding_free_row_padded_to_a_multiple() -> None:
    run = execute(load_engine("trl"), CASE.with_(engine_config=(("pad_to_multiple_of", 8),)))
    assert run.inputs[0]["input_ids"].shape[-1] == 16 and run.inputs[0]["position_ids"][0, 12:].tolist() == [0] * 4


@pytest.mark.skipif(not HAS["trl"], reason="trl is not installed (spec/engines/trl/ci.sh)")
@pytest.mark.parametrize("name", ["trl", "trl-fused"])
def test_trl_packed_row_split_at_the_collators_boundaries(name, monkeypatch) -> None:
    """The padding-free collator's cu_seq_lens_q/k reach the model, which splits the packed row at them (as
    flash-attention's varlen kernel does): a collator handing the whole row as one sequence changes the log-probs.
    Before, the adapter dropped them, and a mutant computing them wrong (torch_call:211 '==' -> '!=') survived."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    engine = load_engine(name)
    want = execute(engine, CASE).outputs["log_probs"]
    original = DataCollatorForLanguageModeling.torch_call

    def one_sequence(self, examples):
        batch = original(self, examples)
        whole = torch.tensor([0, batch["input_ids"].shape[1]], dtype=torch.int32)
        return {**batch, "cu_seq_lens_q": whole, "cu_seq_lens_k": whole}

    monkeypatch.setattr(DataCollatorForLanguageModeling, "torch_call", one_sequence)
    got = execute(engine, CASE).outputs["log_probs"]
    assert not torch.allclose(got.values(), want.values(), atol=1e-3)


@pytest.mark.skipif(not HAS["trl"], reason="trl is not installed (spec/engines/trl/ci.sh)")
def test_trl_model_without_logits_to_keep_refuses_it(monkeypatch) -> None:
    """model_takes_logits_to_keep drawn off is a model whose forward's signature lacks logits_to_keep: a scoring that
    hands it anyway fails, as Python refuses the keyword. Before, the stand-in swallowed it, and a mutant handing it
    whatever model_kwarg_keys say (SDFTTrainer._forward_logits:1108 negated) survived."""
    from trl.experimental.sdft.sdft_trainer import SDFTTrainer

    case = CASE.with_(use_remove_padding=False)
    execute(load_engine("trl"), case)
    original = SDFTTrainer._forward_logits

    def asks_anyway(self, model, input_ids, attention_mask, logits_to_keep):
        keys = self.model_kwarg_keys
        self.model_kwarg_keys = ("logits_to_keep",)
        try:
            return original(self, model, input_ids, attention_mask, logits_to_keep)
        finally:
            self.model_kwarg_keys = keys

    monkeypatch.setattr(SDFTTrainer, "_forward_logits", asks_anyway)
    with pytest.raises(Exception, match=r"unexpected keyword argument 'logits_to_keep'"):
        execute(load_engine("trl"), case)


@pytest.mark.skipif(not HAS["trl"], reason="trl is not installed (spec/engines/trl/ci.sh)")
@pytest.mark.parametrize("name", ["trl", "trl-fused"])
def test_trl_sft_collator_right_pads_whole_sequences(name) -> None:
    engine = load_engine(name)
    case = CASE.with_(use_remove_padding=False, engine_config=(("sft_collator", True),))
    inputs = execute(engine, case).inputs[0]
    assert engine.padded_layout_of(case).value == "right" and engine.padded_layout_of(CASE).value == "left_right"
    assert inputs["attention_mask"].tolist() == [[1] * 5, [1] * 5, [1, 1, 0, 0, 0]]
    assert inputs["input_ids"].shape == (3, 5)


@pytest.mark.skipif(not HAS["trl"], reason="trl is not installed (spec/engines/trl/ci.sh)")
@pytest.mark.parametrize("name, config, detached", [
    ("trl", (("entropy_requires_grad", False),), {"entropy"}),
    ("trl-fused", (("compute_loss_func", True),), {"log_probs", "entropy"}),
    ("trl", (), set()), ("trl-fused", (), set())])
def test_trl_metric_switches_detach_their_outputs(name, config, detached) -> None:
    outputs = execute(load_engine(name), CASE.with_(engine_config=config)).outputs
    assert {key for key, value in outputs.items() if not value.requires_grad} == detached


@pytest.mark.skipif(not HAS["openrlhf"], reason="openrlhf is not installed (spec/engines/openrlhf/ci.sh)")
@pytest.mark.parametrize("config", [(("action_mask", True),), (("stack", False),), (("return_logprobs", False),),
                                    (("return_logprobs", False), ("action_mask", True))])
@pytest.mark.parametrize("packed", [True, False])
def test_openrlhf_switches_change_the_path_not_the_outputs(config, packed) -> None:
    _same_as_off("openrlhf", config, packed)


@pytest.mark.skipif(not HAS["openrlhf"], reason="openrlhf is not installed (spec/engines/openrlhf/ci.sh)")
def test_openrlhf_gathered_logits_padded_as_the_log_probs() -> None:
    """Padded, ``allgather_logits`` leaves the logits-only return's logits as they are (no packing to undo)."""
    _same_as_off("openrlhf", (("return_logprobs", False), ("allgather_logits", True)), False)


@pytest.mark.skipif(not HAS["openrlhf"], reason="openrlhf is not installed (spec/engines/openrlhf/ci.sh)")
def test_openrlhf_gathered_packed_logits_keep_the_packed_axis() -> None:
    """The known failure GATHERED_LOGITS (spec/engines/openrlhf/config.py): packed, ``allgather_logits`` re-pads the
    logits-only return's ``(1, n, V)`` logits to ``(B, L, 1, V)``; its caller refuses them, naming the shape."""
    engine = load_engine("openrlhf")
    case = CASE.with_(use_remove_padding=True, engine_config=(("return_logprobs", False), ("allgather_logits", True)))
    assert GATHERED_LOGITS(case) and not GATHERED_LOGITS(case.with_(use_remove_padding=False))
    width = max(p + r for p, r in zip(CASE.prompt_lens, CASE.response_lens))
    with pytest.raises(ValueError, match=rf"shape \(3, {width}, 1, 9\), expected \(B, L, V\) = \(3, {width}, 9\)"):
        execute(engine, case)


@pytest.mark.skipif(not HAS["openrlhf"], reason="openrlhf is not installed (spec/engines/openrlhf/ci.sh)")
def test_openrlhf_action_mask_scores_the_response_only() -> None:
    engine = load_engine("openrlhf")
    case = CASE.with_(engine_config=(("action_mask", True),))
    log_probs = execute(engine, case).outputs["log_probs"].unbind()
    assert [seq[: p - 1].abs().sum().item() for seq, p in zip(log_probs, case.prompt_lens)] == [0.0, 0.0, 0.0]
    assert engine.output_span_of(case).value == "response" and engine.output_span_of(CASE).value == "sequence"


def _family_cases():
    from spec.engines.trl.vision_families import FAMILY_CASES
    return [case.with_(use_remove_padding=False) for case in FAMILY_CASES]


@pytest.mark.skipif(not HAS["trl"], reason="trl is not installed (spec/engines/trl/ci.sh)")
@pytest.mark.parametrize("case", _family_cases(), ids=lambda c: dict(c.engine_config)["vision_family"])
def test_trl_fused_vision_families_are_sliced_per_chunk(case, monkeypatch) -> None:
    """Each vision family's processor output (vision_family) through GRPO's chunked scoring (score_chunk): GRPO calls
    the backbone once per chunk with that family's keys (its own slicing branch), and the images the stand-in reads
    back are the case's: the outputs are the Qwen2-VL run's. Idefics3's per-sample layout with images as many as rows,
    spread unevenly, is TRL's PER_SAMPLE_AS_PER_IMAGE: the model is handed other rows' image slots."""
    from trl.trainer import grpo_trainer
    from spec.engines.trl.records import PER_SAMPLE_LAYOUT
    from spec.engines.trl.vision_families import FAMILY_KEYS
    calls = []
    original = grpo_trainer.GRPOTrainer._get_per_token_logps_and_entropies.__wrapped__

    def recording(trainer, model, *args, **kwargs):
        model.register_forward_pre_hook(lambda _, __, kw: calls.append(sorted(k for k in kw if k in FAMILY_KEYS)),
                                        with_kwargs=True)
        return original(trainer, model, *args, **kwargs)
    monkeypatch.setattr(grpo_trainer.GRPOTrainer._get_per_token_logps_and_entropies, "__wrapped__", recording)
    engine, family = load_engine("trl-fused"), dict(case.engine_config)["vision_family"]
    if PER_SAMPLE_LAYOUT(case):
        with pytest.raises(ValueError, match="hold other image slots"):
            execute(engine, case)
        return
    at = Ctx(engine, case, "cpu", case.mode).read
    got, want = _read(engine, case, at), _read(engine, case.with_(engine_config=()), at)
    assert torch.allclose(torch.tensor(got["log_probs"]), torch.tensor(want["log_probs"]), atol=1e-5), family
    chunk = dict(case.engine_config)["score_chunk"]
    assert len(calls) >= 2 * -(-len(case.prompt_lens) // chunk), calls  # every chunk, in both runs of the forward
    assert any("pixel_values" in keys for keys in calls), calls


@pytest.mark.skipif(not HAS["trl"], reason="trl is not installed (spec/engines/trl/ci.sh)")
@pytest.mark.parametrize("key", ["image_sizes", "image_position_ids", "spatial_shapes"])
def test_trl_fused_an_image_sliced_off_its_size_is_caught(key, monkeypatch) -> None:
    """A chunk handed its images beside another image's size or patch places (GRPO slicing the family's size key off
    the image range, here: rolled by one image) reaches the stand-in as other patches under other grids: INV-MM-001
    (the images the model is handed are the case's) fails on the family's reach case."""
    from trl.trainer import grpo_trainer
    from spec.invariants import CATALOGUE
    family = {"image_sizes": "llava_next", "image_position_ids": "gemma4", "spatial_shapes": "lfm2_vl"}[key]
    case = next(c for c in _family_cases() if dict(c.engine_config)["vision_family"] == family)
    original = grpo_trainer.GRPOTrainer._get_per_token_logps_and_entropies.__wrapped__

    def missliced(trainer, model, *args, **kwargs):
        kwargs[key] = kwargs[key].roll(1, 0)
        return original(trainer, model, *args, **kwargs)
    engine = load_engine("trl-fused")
    CATALOGUE["INV-MM-001"].check(Ctx(engine, case, "cpu", "padded"))  # passes as TRL slices it
    monkeypatch.setattr(grpo_trainer.GRPOTrainer._get_per_token_logps_and_entropies, "__wrapped__", missliced)
    with pytest.raises(AssertionError):
        CATALOGUE["INV-MM-001"].check(Ctx(engine, case, "cpu", "padded"))
