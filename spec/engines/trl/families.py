"""Stand-ins of other model families for trl-fused's switches (config.py's ``logit_scaling`` and ``moe_router``): the
harness's hidden states and head weight handed to TRL's fused head as a model whose config carries that family's
attributes (a logit scale, an MoE router), so TRL's own branches for them run and the logits stay the stand-in's."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ..kit import HiddenStatesModel
from .config import LOGIT_SCALINGS, MOE_CONFIG

__all__ = ["stand_in"]


class _StandIn(HiddenStatesModel):
    """The stand-in of another model family (config.py's ``logit_scaling`` and ``moe_router``): its config carries
    ``attributes``; its own forward returns the logits times ``scale`` (what TRL multiplies them by, as that family's
    model does); an MoE one's backbone returns router logits where asked (``output_router_logits``)."""

    def __init__(self, hidden, weight, attributes: dict, scale: float = 1.0, experts: int = 0):
        super().__init__(hidden, weight)
        for name, value in attributes.items():
            setattr(self.config, name, value)
        self.scale = scale
        if experts:
            self.model = self.base_model = _RoutedBackbone(self.model, experts)

    def forward(self, *args, **kwargs):
        return SimpleNamespace(logits=super().forward(*args, **kwargs).logits * self.scale)


class _RoutedBackbone(torch.nn.Module):
    """An MoE backbone: the harness's hidden states, and where asked (``output_router_logits``) each of two layers'
    router logits ``(tokens, experts)``, a fixed projection of the hidden states (they feed the load-balancing loss
    only, never the log-probs)."""

    def __init__(self, inner, experts: int):
        super().__init__()
        self.inner, self.lm_head, self.experts = inner, inner.lm_head, experts

    def forward(self, *args, output_router_logits: bool = False, **kwargs):
        out = self.inner(*args, **kwargs)
        if not output_router_logits:
            return out
        hidden = out.last_hidden_state
        # finite where the harness poisons the padding's hidden states, as a real router's logits are there
        flat = torch.nan_to_num(hidden.reshape(-1, hidden.shape[-1]).float(), nan=0.0, posinf=0.0, neginf=0.0)
        router = torch.cos(torch.arange(hidden.shape[-1] * self.experts, dtype=torch.float32, device=flat.device)
                           ).reshape(hidden.shape[-1], self.experts)
        return SimpleNamespace(last_hidden_state=hidden, router_logits=(flat @ router, flat @ router.flip(0)))

    def get_output_embeddings(self):
        return self.lm_head


def stand_in(output, config: dict) -> HiddenStatesModel:
    """The harness's ``output`` as the model TRL patches: the stand-in, or one of the family the switches draw
    (config.py): a config scaling the logits by 1/16 with the head weight handed times 16 (the same logits, bit for
    bit), an MoE config whose backbone returns router logits."""
    scaling, moe = config.get("logit_scaling"), config.get("moe_router")
    if not scaling and not moe:
        return HiddenStatesModel(output.hidden_states, output.lm_head_weight)
    attribute, value, scale = LOGIT_SCALINGS[scaling] if scaling else (None, None, 1.0)
    attributes = {**({attribute: value} if scaling else {}), **(MOE_CONFIG if moe else {})}
    return _StandIn(output.hidden_states, output.lm_head_weight / scale, attributes, scale,
                    MOE_CONFIG["num_experts"] if moe else 0)
