"""Audio clips (docs/contract.md, "Audio"): the stand-in audio tower reads each clip's frames under its mask at its own
audio tokens, the harness's input check and INV-MM-003's check name a mismatch and accept any padding past the masks,
impl pads the samples' clips to the longest, the oracle stays per sample, and the strategies draw clips only where
an engine takes them, with 1-D positions.

Cost: about 10 s on one core (the drawn tests hold 20-30 small cases each).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import impl
from spec.cases.materialize import draws, materialize
from spec.cases.media import with_audio, with_media
from spec.cases.strategies import engine_cases
from spec.cases.structure import EngineCase, Media
from spec.execute.handoff import check_media_inputs, model_for
from spec.protocol.profile import AUDIO_INPUT_KEYS, MEDIA, VISION, EngineProfile
from spec.truth.audio import AUDIO_STRIDE, N_MELS, audio_token_id, clips, pad_clips
from spec.truth.media_checks import media_inputs_handed, samples_media
from spec.truth.oracle import expected, expected_loop
from spec.truth.vision import media_token_ids

FEATURES, MASK = AUDIO_INPUT_KEYS
#: three samples: a clip of 5 frames, a text-only sample, clips of 4 and 7 frames (widths 5, -, 7)
CASE = EngineCase(prompt_lens=(5, 2, 7), response_lens=(2, 1, 3), vocab=16, seed=4,
                  media=((Media("audio", gap=1, frames=5),), (), (Media("audio", frames=4), Media("audio", gap=1, frames=7))))
audio_cases = engine_cases(media=("audio",), positions=("rope",), tier="small").filter(lambda c: bool(c.media))


def _logits(case: EngineCase, **media) -> list[torch.Tensor]:
    d = draws(case)
    return model_for(case, "cpu").sequence_logits(d.ids, d.position_ids(case), case.seq_lens, **media).split(case.seq_lens)


def test_a_sample_hands_its_clips_as_a_feature_extractor_does() -> None:
    d = draws(CASE)
    token = audio_token_id(CASE.vocab)
    per_seq = d.ids.split(CASE.seq_lens)
    assert [int((s == token).sum()) for s in per_seq] == [2, 0, 2 + 3]  # frames // AUDIO_STRIDE per clip
    assert per_seq[0][1:3].tolist() == [token] * 2 and per_seq[0][0] != token  # after its gap of one text token
    assert d.position_ids(CASE).shape == (CASE.total_nnz,)  # 1-D positions: an audio model is a text model
    stack = materialize(CASE).get("multi_modal_inputs").tolist()
    own = stack[2]
    assert own[FEATURES].shape == (2, N_MELS, 7) and own[MASK].tolist() == [[1] * 4 + [0] * 3, [1] * 7]
    silence = own[FEATURES][0, :, 4:]
    assert torch.all(silence == silence[0, 0]) and silence[0, 0] != 0  # the sample's padding: silence, not zeros
    joined = d.media_inputs()
    assert joined[FEATURES].shape == (3, N_MELS, 7) and joined[MASK].sum(-1).tolist() == [5, 4, 7]
    assert torch.equal(joined[FEATURES][0, :, 5:], torch.zeros(N_MELS, 2))  # padded to the batch's longest


def test_a_clip_dropped_reordered_cut_or_read_past_its_mask_changes_its_samples_logits() -> None:
    media = draws(CASE).media_inputs()
    right = _logits(CASE, **media)
    feats, mask = media[FEATURES], media[MASK]
    ones = mask.clone()
    ones[1, 4:] = 1  # clip 1 read past its 4 frames
    cut = mask.clone()
    cut[2, 0] = 0  # clip 2 loses its first frame: 6 frames, 3 tokens, as many as before, each a frame later
    for name, other in (("reordered", {FEATURES: feats[[0, 2, 1]], MASK: mask[[0, 2, 1]]}),
                        ("read past its mask", {FEATURES: feats, MASK: ones}),
                        ("its first frame dropped", {FEATURES: feats, MASK: cut}),
                        ("values shifted", {FEATURES: feats.roll(1, -1), MASK: mask})):
        wrong = _logits(CASE, **other)
        assert not torch.equal(wrong[2], right[2]), name
        assert torch.equal(wrong[1], right[1]), f"{name}: the text-only sample's logits moved"
    # any padding past the masks, as wide and with what values an engine likes, reads the same
    wider = {FEATURES: torch.nn.functional.pad(feats, (0, 3), value=9.0), MASK: torch.nn.functional.pad(mask, (0, 3))}
    filled = {FEATURES: torch.where(mask.bool().unsqueeze(1), feats, torch.tensor(-5.0)), MASK: mask}
    for other in (wider, filled):
        assert all(torch.equal(a, b) for a, b in zip(_logits(CASE, **other), right))


def test_the_input_check_names_a_mismatch() -> None:
    d = draws(CASE)
    ids, media = d.ids.unsqueeze(0), d.media_inputs()
    check_media_inputs({"input_ids": ids, **media}, CASE)
    ones = media[MASK].clone()
    ones[0, 5:] = 1
    for broken, words in (({FEATURES: media[FEATURES]}, "audio tokens without the clips' features and mask"),
                          ({FEATURES: media[FEATURES], MASK: ones}, "the masks name 8 tokens"),
                          ({FEATURES: media[FEATURES][:, :2], MASK: media[MASK]}, f"must be (clips, {N_MELS}, frames)")):
        with pytest.raises(AssertionError, match=words.replace("(", r"\(").replace(")", r"\)")):
            check_media_inputs({"input_ids": ids, **broken}, CASE)
    # a vision-language case's text token that equals the audio id is text: no audio check there
    visual = with_media(EngineCase(prompt_lens=(3, 2), response_lens=(2, 1), vocab=16, seed=1))
    vd = draws(visual)
    check_media_inputs({"input_ids": vd.ids.unsqueeze(0), **vd.media_inputs()}, visual)


def _handed(case: EngineCase, media: dict) -> None:
    d = draws(case)
    groups = {"audio": sum(m.tokens for items in case.media for m in items)}
    media_inputs_handed([(d.ids.unsqueeze(0), media)], d.media_inputs(), *media_token_ids(case.vocab), d.ids, groups,
                        audio_id=audio_token_id(case.vocab))


def test_inv_mm_003s_check_reads_the_frames_under_the_masks_whatever_the_padding() -> None:
    media = draws(CASE).media_inputs()
    _handed(CASE, media)
    entries = [e for e in materialize(CASE).get("multi_modal_inputs").tolist() if e]
    own_widths = {FEATURES: torch.cat([torch.nn.functional.pad(e[FEATURES], (0, 9 - e[FEATURES].shape[-1]), value=3.0)
                                       for e in entries]),
                  MASK: torch.cat([torch.nn.functional.pad(e[MASK], (0, 9 - e[MASK].shape[-1])) for e in entries])}
    _handed(CASE, own_widths)  # padded to 9 frames with 3.0: another engine's convention, the same clips
    ones = media[MASK].clone()
    ones[1, 4:] = 1
    swapped = {FEATURES: media[FEATURES][[1, 0, 2]], MASK: media[MASK][[1, 0, 2]]}
    for broken, words in (({FEATURES: media[FEATURES], MASK: ones}, "audio clip 1"),
                          (swapped, "audio clip 0"),
                          ({FEATURES: media[FEATURES]}, "media keys"),
                          ({FEATURES: media[FEATURES][:2], MASK: media[MASK][:2]}, "holds 2 clips")):
        with pytest.raises(AssertionError, match=words):
            _handed(CASE, broken)


def test_the_samples_clips_concatenate_padded_to_the_longest() -> None:
    a = {FEATURES: torch.ones(1, N_MELS, 3), MASK: torch.tensor([[1, 1, 0]])}
    b = {FEATURES: torch.full((2, N_MELS, 5), 2.0), MASK: torch.tensor([[1] * 5, [1, 1, 1, 0, 0]])}
    joined = samples_media([a, None, {}, b])
    assert joined[FEATURES].shape == (3, N_MELS, 5) and joined[MASK].tolist() == [[1, 1, 0, 0, 0], [1] * 5,
                                                                                  [1, 1, 1, 0, 0]]
    assert [c.shape[-1] for c in clips(joined[FEATURES], joined[MASK])] == [2, 5, 3]
    with pytest.raises(ValueError, match="do not pair"):
        clips(joined[FEATURES], joined[MASK][:, :4])
    features, mask = pad_clips([a[FEATURES]], [a[MASK]])
    assert torch.equal(features, a[FEATURES]) and torch.equal(mask, a[MASK])


def test_impl_pads_the_samples_clips_to_the_longest() -> None:
    entries = materialize(CASE).get("multi_modal_inputs")
    got = impl.extract_multi_modal_inputs(entries)
    want = draws(CASE).media_inputs()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    bad = [{FEATURES: torch.zeros(1, N_MELS, 3)}, {FEATURES: torch.zeros(1, N_MELS + 1, 4)}]
    with pytest.raises(impl.ShapeError, match="input_features"):
        impl.extract_multi_modal_inputs(bad)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=audio_cases)
def test_the_oracle_stays_per_sample_with_clips(case: EngineCase) -> None:
    assert case.has_audio and not case.mrope
    model = model_for(case, "cpu")
    fast, loop = expected(case, model, draws(case)), expected_loop(case, materialize(case), model)
    for a, b in zip(fast.log_probs, loop.log_probs):
        assert torch.equal(a, b)


def test_cases_hold_audio_consistently() -> None:
    with pytest.raises(ValueError, match="mRoPE positions"):
        EngineCase(prompt_lens=(3,), response_lens=(1,), vocab=16, mrope=True, media=((Media("audio", frames=2),),))
    with pytest.raises(ValueError, match="not both"):
        EngineCase(prompt_lens=(4,), response_lens=(1,), vocab=16, mrope=True,
                   media=((Media("audio", frames=2), Media("image", 1, 2, 2)),))
    with pytest.raises(ValueError, match="at least 2"):
        Media("audio", frames=1)
    with pytest.raises(ValueError, match="only an audio clip"):
        Media("image", frames=3)
    assert repr(Media("audio", gap=1, frames=5)) == "aud5+1" and Media("audio", frames=5).tokens == 5 // AUDIO_STRIDE
    with pytest.raises(ValueError, match="1-D positions"):
        EngineProfile(positions=("mrope",), media=("audio",))
    EngineProfile(positions=("rope",), media=("audio",))  # an audio model without images takes no mRoPE
    # an invariant's forcing: clips of unequal lengths, 1-D positions; an audio case given a vision case's forcing
    forced = with_audio(EngineCase(prompt_lens=(3, 2, 4), response_lens=(1, 1, 2), vocab=6, seed=2))
    assert forced.has_audio and not forced.mrope and forced.vocab == 16
    assert len({m.frames for items in forced.media for m in items}) > 1
    assert with_media(forced).mrope and not with_media(forced).has_audio


def test_the_strategies_draw_clips_only_where_an_engine_takes_them() -> None:
    seen = {"audio": 0, "vision": 0}

    @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True)
    @given(case=engine_cases(media=MEDIA, tier="small"))
    def every_kind(case: EngineCase) -> None:
        kinds = {m.kind for items in case.media for m in items}
        assert not (kinds & set(VISION) and "audio" in kinds)
        if "audio" in kinds:
            assert not case.mrope
            seen["audio"] += 1
        if kinds & set(VISION):
            assert case.mrope
            seen["vision"] += 1

    every_kind()
    assert seen["audio"] and seen["vision"], seen

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True)
    @given(case=engine_cases(media=VISION, tier="small"))
    def no_audio(case: EngineCase) -> None:
        assert not case.has_audio

    no_audio()
