"""Planted bugs in prepare_model_outputs and the value head."""

from __future__ import annotations

import torch

import impl
from impl.dense import jagged_to_padded
from impl.flags import read_flag

from ..protocol.profile import ROUTES_RECORDED, ROUTES_SWITCH, ConfigSwitch
from ..truth.routes import RECORDED_DTYPE, model_routes, places
from .inputs_bugs import _is_padded


class DropDistillationPadded(impl.LMHeadEngine):
    """verl #6293: the padded branch forgets the logits processor's keys (KeyError downstream)."""

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        out = super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)
        if _is_padded(mb):
            out = {k: v for k, v in out.items() if k in ("log_probs", "entropy", "sum_pi_squared")}
        return out


class SumPiSquaredMissingPadded(impl.LMHeadEngine):
    """The padded branch ignores calculate_sum_pi_squared."""

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        out = super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)
        if _is_padded(mb):
            out.pop("sum_pi_squared", None)
        return out


class NoTemperaturePadded(impl.LMHeadEngine):
    """The padded branch forgets to divide by temperature."""

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        if "temperature" in oa:
            oa = {**oa, "temperature": torch.ones_like(oa["temperature"])}
        return super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)


class DoubleTemperature(impl.LMHeadEngine):
    """The packed branch divides by temperature twice."""

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        if "temperature_rmpad" in oa:
            oa = {**oa, "temperature_rmpad": oa["temperature_rmpad"] ** 2}
        return super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)


class StripPadFromHead(impl.LMHeadEngine):
    """The packed tail padding is removed from the head of the row instead of the tail."""

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        pad = oa.get("pad_size", 0)
        if pad and self.settings.sp_size == 1:
            output = {k: torch.roll(v, -pad, dims=1) for k, v in vars(output).items() if isinstance(v, torch.Tensor)}
        return super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)


class GlobalMaxShift(impl.LMHeadEngine):
    """'Numerical stability': the padded logits are shifted by their global max, padding included."""

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        if _is_padded(mb) and getattr(output, "logits", None) is not None:
            logits = output.logits
            output = {"logits": logits - logits.amax(dim=(1, 2), keepdim=True),
                      **{k: v for k, v in vars(output).items() if k != "logits"}}
        return super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)


class MutateLogits(impl.LMHeadEngine):
    """Temperature is applied in place on the model's logits (the caller's tensor changes)."""

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        logits = getattr(output, "logits", None)
        if logits is not None and not read_flag(mb, "use_fused_kernels", False):
            if "temperature_rmpad" in oa:
                logits[0].div_(oa["temperature_rmpad"].unsqueeze(-1))
                oa = {**oa, "temperature_rmpad": torch.ones_like(oa["temperature_rmpad"])}
            else:
                logits.div_(oa["temperature"].view(-1, 1, 1))
                oa = {**oa, "temperature": torch.ones_like(oa["temperature"])}
        return super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)


class ValueTrailingDim(impl.ValueHeadEngine):
    """verl 0.7.1's value head: the padded branch keeps the trailing 1, (B, j, 1)."""

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        out = super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)
        if _is_padded(mb):
            v = out["values"]
            out["values"] = torch.nested.nested_tensor_from_jagged(v.values().unsqueeze(-1), v.offsets())
        return out


class DenseOutputsPadded(impl.LMHeadEngine):
    """The padded branch returns per-token outputs as dense (B, L) tensors, not nested."""

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        out = super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)
        if _is_padded(mb):
            # impl's padding, not torch.nested.to_padded_tensor (no CPU kernel on torch 2.4)
            out = {k: jagged_to_padded(v.values(), v.offsets(), int(v.offsets().diff().max()), 0.0)
                   for k, v in out.items()}
        return out


class OutputsFloat64(impl.LMHeadEngine):
    """Outputs come back in float64."""

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        out = super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)
        return {k: torch.nested.nested_tensor_from_jagged(v.values().double(), v.offsets()) for k, v in out.items()}


class NanToNumThenGlobalShift(impl.LMHeadEngine):
    """Padded logits: NaN scrubbed to 0, then shifted by the global max (huge padding wins)."""

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        if _is_padded(mb) and getattr(output, "logits", None) is not None:
            logits = output.logits.nan_to_num(0.0)
            logits = logits - logits.amax()
            output = {"logits": logits, **{k: v for k, v in vars(output).items() if k != "logits"}}
        return super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)


class IdentityShortcut(impl.LMHeadEngine):
    """When every temperature is 1, log_probs return the raw logit of the label (no normalisation)."""

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        out = super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)
        temps = oa.get("temperature_rmpad", oa.get("temperature"))
        logits = getattr(output, "logits", None)
        if "log_probs" in out and logits is not None and bool((temps == 1).all()) and "temperature_rmpad" in oa \
                and self.settings.sp_size == 1:
            labels = oa["input_ids_rmpad_rolled"]
            raw = logits[0].gather(-1, labels.unsqueeze(-1)).squeeze(-1)[: out["log_probs"].values().shape[0]]
            out["log_probs"] = torch.nested.nested_tensor_from_jagged(raw.float(), out["log_probs"].offsets())
        return out


class SumPiNotSquared(impl.LMHeadEngine):
    """sum_pi_squared returns sum(p) ** 2 instead of sum(p ** 2)."""

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        out = super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)
        if "sum_pi_squared" in out and "entropy" in out:
            v = out["sum_pi_squared"]
            out["sum_pi_squared"] = torch.nested.nested_tensor_from_jagged(v.values().sqrt(), v.offsets())
        elif "sum_pi_squared" in out:
            v = out["sum_pi_squared"]
            out["sum_pi_squared"] = torch.nested.nested_tensor_from_jagged(torch.ones_like(v.values()), v.offsets())
        return out


class ValueHeadDividesByTemperature(impl.ValueHeadEngine):
    """The value head divides its output by the sampling temperature, like the LM head's logits."""

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        out = super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)
        temps = read_flag(mb, "temperature", 1.0)
        v = out["values"]
        if isinstance(temps, torch.Tensor):
            temps = torch.repeat_interleave(temps.float(), v.offsets().diff())
        out["values"] = torch.nested.nested_tensor_from_jagged(v.values() / temps, v.offsets())
        return out


class ChunkDropsTail(impl.LMHeadEngine):
    """With an entropy chunk size, the last partial chunk of tokens is never computed (left at 0)."""

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        out = super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)
        size = self.settings.entropy_chunk_size
        if size:
            for key in ("log_probs", "entropy", "sum_pi_squared"):
                if key in out:
                    values = out[key].values().clone()
                    values[(values.shape[0] // size) * size:] = 0
                    out[key] = torch.nested.nested_tensor_from_jagged(values, out[key].offsets())
        return out


class FreesOutputArgs(impl.LMHeadEngine):
    """prepare_model_outputs pops the rolled labels from output_args once used ("to free memory")."""

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        out = super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)
        oa.pop("input_ids_rmpad_rolled", None)
        return out


#: router replay's R2 record on (the switch an engine records routes with: spec.protocol.profile.ROUTES_RECORDED)
RECORDS = ConfigSwitch(ROUTES_SWITCH, (None, ROUTES_RECORDED),
                       "router replay's R2 record: the MoE routers' own routes recorded and returned per sample")


class _RecordsRoutes(impl.LMHeadEngine):
    """An engine recording the MoE routers' routes under R2 (``routed_experts`` drawn to ``record``): the routes the
    stand-in model's routers take at every row of the packed row (each token by its id and place in its sequence;
    the tail padding's too), returned per sample as the output ``routed_experts``; :meth:`_cut` drops the padding."""

    def __init__(self, **settings):
        self.record = settings.pop(ROUTES_SWITCH, None) == ROUTES_RECORDED
        super().__init__(**settings)

    def _cut(self, rows: torch.Tensor, pad: int) -> torch.Tensor:
        return rows[:rows.shape[0] - pad]

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        out = super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)
        if self.record:
            ids = mb["input_ids"]
            pad = 0 if _is_padded(mb) else int(oa.get("pad_size", 0) or 0)
            row = torch.cat([ids.values().cpu(), torch.zeros(pad, dtype=torch.int64)])
            rows = self._cut(model_routes(row, RECORDED_DTYPE, places(ids.offsets(), row.numel())), pad)
            out["routed_experts"] = torch.nested.nested_tensor_from_jagged(rows.to(torch.int16), ids.offsets().cpu())
        return out


class RecordPadAtHead(_RecordsRoutes):
    """Under router replay's R2 record, the recorded routes of the packed row drop the tail padding's rows from the
    row's head instead of its tail: with tail padding (a static bucket, sequence parallelism), every recorded route
    is that of a token ``pad_size`` places later (INV-ROUTE-002)."""

    def _cut(self, rows: torch.Tensor, pad: int) -> torch.Tensor:
        return rows[pad:]


class RecordOneTokenLate(_RecordsRoutes):
    """Under router replay's R2 record, the routes are recorded against the labels' row (rolled by one): each token
    gets the recorded route of the token before it, the row's first that of the last (INV-ROUTE-002)."""

    def _cut(self, rows: torch.Tensor, pad: int) -> torch.Tensor:
        return rows[:rows.shape[0] - pad].roll(1, 0)
