"""Images and videos (docs/contract.md, "Images and videos"): the rope index equals Qwen2-VL's loop, the stand-in vision
tower puts each sample's features at its own media tokens, the harness's input check names a mismatch, impl hands the
model the samples' features in order, the oracle stays per sample, and the strategies draw what the contract names.

Cost: about 10 s on one core (the drawn tests hold 20-40 small cases each).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import impl
from impl.multimodal import multi_modal_model_inputs
from spec.cases.materialize import draws, materialize
from spec.cases.structure import EngineCase, Media
from spec.cases.strategies import engine_cases
from spec.execute.handoff import check_media_inputs, model_for
from spec.protocol.profile import MEDIA, VISION
from spec.truth.media_checks import media_inputs_handed
from spec.truth.oracle import expected, expected_loop
from spec.truth.vision import media_token_ids, rope_index

CASE = EngineCase(prompt_lens=(5, 2, 7), response_lens=(2, 1, 3), vocab=16, mrope=True, seed=4,
                  media=((Media("image", 1, 2, 4, 1),), (), (Media("video", 2, 2, 2, 0), Media("image", 1, 4, 2, 1))))
media_cases = engine_cases(media=VISION, tier="small").filter(lambda c: bool(c.media))


def rope_loop(ids: list[int], items: tuple[Media, ...], vocab: int) -> torch.Tensor:
    """Qwen2-VL's ``get_rope_index`` for one sequence, as transformers writes it (a loop over its media items, the
    next item found by the first media token at or after the pointer; temporal step 1)."""
    image_id, video_id = media_token_ids(vocab)
    images = [m for m in items if m.kind == "image"]
    videos = [m for m in items if m.kind == "video"]
    parts, st_ = [], 0
    for _ in range(len(items)):
        ed_image = ids.index(image_id, st_) if images and image_id in ids[st_:] else len(ids) + 1
        ed_video = ids.index(video_id, st_) if videos and video_id in ids[st_:] else len(ids) + 1
        item = images.pop(0) if ed_image < ed_video else videos.pop(0)
        ed = min(ed_image, ed_video)
        t, h, w = item.t, item.h // 2, item.w // 2
        start = int(parts[-1].max()) + 1 if parts else 0
        parts.append(torch.arange(ed - st_).view(1, -1).expand(3, -1) + start)
        t_index = torch.arange(t).view(-1, 1).expand(-1, h * w).flatten()
        h_index = torch.arange(h).view(1, -1, 1).expand(t, -1, w).flatten()
        w_index = torch.arange(w).view(1, 1, -1).expand(t, h, -1).flatten()
        parts.append(torch.stack([t_index, h_index, w_index]) + (ed - st_) + start)
        st_ = ed + t * h * w
    if st_ < len(ids):
        start = int(parts[-1].max()) + 1 if parts else 0
        parts.append(torch.arange(len(ids) - st_).view(1, -1).expand(3, -1) + start)
    return torch.cat(parts, dim=1)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=media_cases)
def test_rope_index_is_qwen2_vls_loop_and_the_oracle_stays_per_sample(case: EngineCase) -> None:
    d = draws(case)
    got = d.position_ids(case)
    assert got.shape == (4, case.total_nnz)
    for i, (ids, pos) in enumerate(zip(d.ids.split(case.seq_lens), got.split(case.seq_lens, dim=1))):
        assert torch.equal(pos[0], torch.arange(case.seq_lens[i])), "axis 0: the text positions"
        assert torch.equal(pos[1:], rope_loop(ids.tolist(), case.media[i], case.vocab)), (case, i)
    model = model_for(case, "cpu")
    fast, loop = expected(case, model, d), expected_loop(case, materialize(case), model)
    for a, b in zip(fast.log_probs, loop.log_probs):
        assert torch.equal(a, b)


def test_media_tokens_and_features_per_sample() -> None:
    d = draws(CASE)
    image_id, video_id = media_token_ids(CASE.vocab)
    per_seq = d.ids.split(CASE.seq_lens)
    assert [int((s == image_id).sum()) for s in per_seq] == [2, 0, 2]
    assert [int((s == video_id).sum()) for s in per_seq] == [0, 0, 2]
    assert per_seq[0][1:3].tolist() == [image_id] * 2  # after its gap of one text token
    inputs = d.media_inputs()
    assert inputs["pixel_values"].shape == (16, 6) and inputs["image_grid_thw"].tolist() == [[1, 2, 4], [1, 4, 2]]
    assert inputs["video_grid_thw"].tolist() == [[2, 2, 2]]
    stack = materialize(CASE).get("multi_modal_inputs").tolist()
    assert stack[1] in ({}, None) and torch.equal(stack[0]["pixel_values"], inputs["pixel_values"][:8])


def _logits(case: EngineCase, **media) -> torch.Tensor:
    d = draws(case)
    return model_for(case, "cpu").sequence_logits(d.ids, d.position_ids(case), case.seq_lens, **media)


def test_a_feature_dropped_reordered_or_under_another_grid_changes_its_samples_logits() -> None:
    media = draws(CASE).media_inputs()
    right = _logits(CASE, **media).split(CASE.seq_lens)
    swapped = dict(media, pixel_values=torch.cat([media["pixel_values"][8:], media["pixel_values"][:8]]))
    regrid = dict(media, image_grid_thw=media["image_grid_thw"].flip(0))
    shifted = dict(media, pixel_values=media["pixel_values"].roll(4, 0))
    no_video = {k: v for k, v in media.items() if "video" not in k}
    for name, other in (("reordered", swapped), ("another grid", regrid), ("misaligned", shifted),
                        ("dropped", no_video)):
        wrong = _logits(CASE, **other).split(CASE.seq_lens)
        assert not torch.equal(wrong[2], right[2]), name
        assert torch.equal(wrong[1], right[1]), f"{name}: the text-only sample's logits moved"
    # before the first media token nothing changes; from it on every token sees it
    wrong = _logits(CASE, **swapped).split(CASE.seq_lens)
    assert torch.equal(wrong[0][:1], right[0][:1]) and not torch.equal(wrong[0][-1], right[0][-1])


def test_the_input_check_names_a_mismatch() -> None:
    d = draws(CASE)
    ids = d.ids.unsqueeze(0)
    media = d.media_inputs()
    check_media_inputs({"input_ids": ids, **media}, CASE)
    for broken, words in ((dict(media, pixel_values=media["pixel_values"][:12]), "pixel_values (12, 6)"),
                          ({k: v for k, v in media.items() if not k.startswith("image") and k != "pixel_values"},
                           "image tokens without"),
                          (dict(media, image_grid_thw=media["image_grid_thw"][:1]), "image_grid_thw (1, 3)")):
        with pytest.raises(AssertionError, match=words.replace("(", r"\(").replace(")", r"\)")):
            check_media_inputs({"input_ids": ids, **broken}, CASE)


def test_impl_hands_the_samples_features_in_order() -> None:
    mb = materialize(CASE)
    for packed in (True, False):
        mb.set_non_tensor("use_remove_padding", packed)
        model_inputs, _ = impl.LMHeadEngine().prepare_model_inputs(mb)
        want = draws(CASE).media_inputs()
        assert set(want) <= set(model_inputs)
        for key, value in want.items():
            assert torch.equal(model_inputs[key], value), (packed, key)
    entries = [{"pixel_values": torch.ones(4, 6)}, None, {}, {"pixel_values": torch.zeros(8, 6)}]
    joined = impl.extract_multi_modal_inputs(entries)
    assert joined["pixel_values"][:4].eq(1).all() and joined["pixel_values"].shape == (12, 6)
    assert impl.extract_multi_modal_inputs(entries, indices=[3, 0])["pixel_values"][:8].eq(0).all()
    with pytest.raises(impl.ShapeError, match="'pixel_values'.*\\(4, 6\\), \\(8, 5\\)"):
        impl.extract_multi_modal_inputs([{"pixel_values": torch.ones(4, 6)}, {"pixel_values": torch.ones(8, 5)}])
    with pytest.raises(impl.ShapeError, match="sample 1 must be a dict"):
        impl.extract_multi_modal_inputs([{}, "image.png"])
    with pytest.raises(impl.BatchMismatchError, match="3 entries for a micro-batch of 1"):
        multi_modal_model_inputs(mb, 1, "cpu")


def test_cases_hold_media_consistently() -> None:
    assert "media=[[img1x2x4+1],[],[vid2x2x2+0,img1x4x2+1]]" in repr(CASE)
    assert repr(CASE.with_(media=())).count("media") == 0
    assert CASE.subset([2, 0]).media == (CASE.media[2], CASE.media[0])
    doubled = CASE.with_(prompt_lens=CASE.prompt_lens * 2, response_lens=CASE.response_lens * 2)
    assert doubled.media == CASE.media * 2
    assert CASE.with_(mrope=False).media == ()
    for bad, words in (({"mrope": False}, "mRoPE"), ({"vocab": 7}, "vocab >= 8"),
                       ({"prompt_lens": (2, 2, 7)}, "sample 0"), ({"media": CASE.media[:2]}, "2 samples")):
        with pytest.raises(ValueError, match=words):
            EngineCase(**{**{f: getattr(CASE, f) for f in ("prompt_lens", "response_lens", "vocab", "mrope", "media")},
                          **bad})
    with pytest.raises(ValueError, match="multiples of the merge size"):
        Media("image", 1, 3, 2)
    with pytest.raises(ValueError, match="an image has t = 1"):
        Media("image", 2, 2, 2)


def test_the_strategies_draw_what_the_contract_names() -> None:
    seen = set()

    @settings(max_examples=300, database=None, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(case=engine_cases(media=MEDIA))
    def look(case: EngineCase) -> None:
        if not case.media:
            return
        kinds = {m.kind for items in case.media for m in items}
        seen.update(kinds)
        seen.add("text-only sample" if not all(case.media) else "every sample")
        seen.add("B = 1" if case.batch_size == 1 else "equal lengths" if len(set(case.seq_lens)) == 1 else "unequal")
        seen.add(case.mode)
        seen.add("two items" if any(len(items) == 2 for items in case.media) else "one item")
        seen.add("sp" if case.sp_size > 1 else "no sp")

    look()
    assert {"image", "video", "text-only sample", "every sample", "B = 1", "unequal", "packed", "padded",
            "two items", "sp"} <= seen, seen

    @settings(max_examples=30, database=None, deadline=None)
    @given(case=engine_cases())
    def none_without_the_profile(case: EngineCase) -> None:
        assert not case.media

    none_without_the_profile()


def test_a_model_left_to_its_own_positions_needs_the_token_types() -> None:
    """INV-MM-001's rule for an engine that hands grids and no position_ids (OpenRLHF's padded VLM path): the model
    computes its own rope index, which a transformers-5 model finds the media tokens for by ``mm_token_type_ids``;
    without them (OpenRLHF's ``if mm_inputs:`` negated, a mutant that survived before) the check fails and names the
    key. The same hand-off with positions, or with the token types, passes."""
    case = EngineCase(prompt_lens=(3,), response_lens=(1,), vocab=16, mrope=True,
                      media=((Media("image", 1, 2, 4, 1),),))
    want, (image_id, video_id) = draws(case).media_inputs(), media_token_ids(case.vocab)
    ids = torch.tensor([[5, image_id, image_id, 7]])
    marks = (ids == image_id).long()
    groups = {"image": 2}
    media_inputs_handed([(ids, dict(want))], want, image_id, video_id, ids, groups, own_positions=[False])
    media_inputs_handed([(ids, {**want, "mm_token_type_ids": marks})], want, image_id, video_id, ids, groups,
                        own_positions=[True])
    with pytest.raises(AssertionError, match=r"no position_ids.*'mm_token_type_ids'"):
        media_inputs_handed([(ids, dict(want))], want, image_id, video_id, ids, groups, own_positions=[True])
