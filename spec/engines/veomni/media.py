"""A vision-language micro-batch through verl's VeOmni engine (engine ``verl-veomni``; docs/contract.md, "Images and
videos").

VeOmni's engine hands the model FSDP's inputs (the samples' media concatenated by ``extract_multi_modal_inputs``) plus
an ``image_mask`` and a ``video_mask`` over the ids (``_apply_veomni_input_transforms``), for a model type listed in
VeOmni's ``VL_TYPE2INDEX``: the type's image and video token ids (Qwen2.5-VL's and Qwen3-VL's 151655 / 151656, read
from that table, not from the model's config). VeOmni's VL models place the features at those masks. The adapter's
stand-in is a VL model type of its own, registered in that table with its media token ids (the micro-batch's flags
beside its media), as a model VeOmni adds is registered; a text micro-batch keeps a text model type.

The engine object also runs router replay where its switch is drawn (:mod:`spec.engines.veomni.router_replay`): the
controller armed before VeOmni's ``prepare_model_inputs``, the MoE routers fired after it.
"""

from __future__ import annotations

from typing import Any

from impl.flags import read_flag

from ..kit.hf_batch import media_samples, media_token_ids
from ..verl.adapter import VerlEngineObject

__all__ = ["VeOmniEngineObject", "STAND_IN_VL_TYPE"]

#: the stand-in's model type as a vision-language one (a key of VeOmni's VL_TYPE2INDEX while a media batch runs)
STAND_IN_VL_TYPE = "rl_ioprep_stand_in_vl"


class VeOmniEngineObject(VerlEngineObject):
    """verl's engine object with the model type a micro-batch's model has: a VL type for one carrying media."""

    vl_types: dict = {}  # VeOmni's VL_TYPE2INDEX (set by VeOmniEngine.make)
    #: router replay (R3) where its switch is drawn (spec/engines/veomni/router_replay.py; set by VeOmniEngine.make)
    router_replay: Any = None

    def prepare_model_inputs(self, micro_batch):
        config = self.verl_engine.module.config
        if media_samples(micro_batch) is None:
            config.model_type = "toy"
        else:
            image_id, video_id = media_token_ids(micro_batch)
            self.vl_types[STAND_IN_VL_TYPE] = {"IMAGE_INPUT_INDEX": image_id, "VIDEO_INPUT_INDEX": video_id}
            config.model_type = STAND_IN_VL_TYPE
        replay = self.router_replay
        # the flag read only with replay on (as verl reads it), so a bad flag otherwise meets verl's own check first
        packed = replay is not None and read_flag(micro_batch, "use_remove_padding", True) not in (False,)
        if replay is not None:
            replay.arm(self.verl_engine, packed)
        model_inputs, output_args = super().prepare_model_inputs(micro_batch)
        if packed:  # the MoE model's routers fire on the inputs, as in its forward (R2: recording their own)
            taken = replay.fire(model_inputs, output_args, micro_batch)
            if not replay.record:
                output_args["routes"] = taken
        return model_inputs, output_args
