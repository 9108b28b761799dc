"""OpenRLHF 0.11.2's critic forward (``openrlhf.models.model._get_critic_model``'s ``CriticModel.forward``) as the value
head the training step's value loss trains (spec/engines/openrlhf/step.py).

``CriticModel`` is a class made inside ``_get_critic_model`` on a transformers base class; its ``forward`` is taken
from a class made on ``object`` (the base only provides ``from_pretrained``) and called unbound on an object holding what
it reads: ``packing_samples``, the base LLM under ``base_model_prefix`` (the suite's stand-in value model, its one-column
output as ``last_hidden_state``) and the value head under ``value_head_prefix`` (the identity: the stand-in's column is
the value), ``normalize_reward`` off. Packed, it unpads the right-padded rows with ``unpad_and_slice_tensor`` and pads
the values back with ``gather_and_pad_tensor`` (OpenRLHF's ring-attention helpers, no ring group); either way it drops
the last column and keeps ``values[:, -action_mask.shape[1]:] * action_mask``, where OpenRLHF's ``action_mask`` spans
every position but the first (``samples_generator``: ``action_mask[1:]``), here all ones so every row's values come
back. As the actor (spec/engines/openrlhf/adapter.py) the forward runs twice: once to record the model inputs, once
with the harness's output replayed. Only the step uses it: the preparation's value invariants are not claimed for
OpenRLHF (its profile lacks the value head, ``Actor.forward`` being the engine under test).
"""

from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace

import torch

from ...protocol import sequences_from_rows
from ..kit import inputs_seen_by_model, replaying, stub_imports
from ..kit.hf_batch import BatchFlags

__all__ = ["OpenRLHFCritic"]


@lru_cache(maxsize=2)
def _critic_forward(packed: bool):
    model = stub_imports("openrlhf.models.model", ("peft", "transformers", "deepspeed", "flash_attn"))
    return model._get_critic_model(object, object, "score", packed).forward


class OpenRLHFCritic:
    """OpenRLHF's critic forward behind the suite's calling convention (see the module docstring)."""

    def __init__(self, utils):
        self.utils = utils  # openrlhf.utils.utils (zero_pad_sequences), as the actor's adapter imported it

    def _forward(self, model, a, action_mask=None):
        critic = SimpleNamespace(packing_samples=a["packed"], base_model_prefix="model", value_head_prefix="score",
                                 normalize_reward=False,
                                 model=lambda input_ids, **kw: {"last_hidden_state": model(input_ids, **kw).logits},
                                 score=lambda hidden: hidden)
        return _critic_forward(a["packed"])(critic, a["sequences"], action_mask=action_mask,
                                            attention_mask=a["attention_mask"], return_output=action_mask is None)

    def prepare_model_inputs(self, mb):
        flags, pad = BatchFlags.from_batch(mb), self.utils.zero_pad_sequences
        seqs = mb["input_ids"].unbind()
        a = {"packed": flags.use_remove_padding,
             "sequences": pad(list(seqs), "right", value=flags.pad_token_id, stack=True),
             "attention_mask": pad([torch.ones_like(s) for s in seqs], "right", stack=True)}
        return inputs_seen_by_model(lambda model: self._forward(model, a)), a

    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None):  # noqa: ARG002
        rows = output_args["sequences"]
        values = self._forward(replaying(output), output_args,
                               action_mask=torch.ones(rows.shape[0], rows.shape[1] - 1, dtype=torch.long))
        # (B, L - 1) rows: the last column (the longest row's last token, scoring nothing) is never computed
        return {"values": sequences_from_rows(torch.cat([values, values.new_zeros(len(values), 1)], 1).float(), mb)}
