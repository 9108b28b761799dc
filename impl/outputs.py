"""``prepare_model_outputs``: model output back to per-token nested tensors.

Both padding modes share every step but the first and the last: a
:class:`TokenRoute` selects the real tokens' rows of a model output (the
packed row of this rank, or the valid positions of the dense batch) and, at the
end, turns per-token results back into one ``(total_nnz,)`` row (all-gather and
tail unpad for the packed mode). Everything in between is mode-agnostic.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from tensordict import TensorDictBase

from .batch import MicroBatchView
from .errors import ShapeError, UnsupportedConfigError
from .dense import padded_to_jagged
from .layout import nested_from_values
from .logits import TEMPERATURE_FLOOR, token_statistics
from .sequence_parallel import RowPlan
from .settings import EngineSettings

__all__ = ["prepare_model_outputs", "prepare_value_outputs", "TokenRoute"]

LogitsProcessor = Callable[..., Mapping[str, torch.Tensor]]


def _field(output: Any, name: str) -> Any:
    if isinstance(output, Mapping):
        return output.get(name)
    return getattr(output, name, None)


def _require_arg(output_args: Mapping[str, Any], key: str) -> Any:
    if key not in output_args:
        raise KeyError(f"output_args has no {key!r} (keys: {sorted(output_args)}); "
                       "pass what prepare_model_inputs returned for the same micro-batch and mode")
    return output_args[key]


class TokenRoute:
    """Moves per-token tensors between the model's layout and one packed row."""

    def __init__(self, view: MicroBatchView, output_args: Mapping[str, Any], settings: EngineSettings):
        self.view = view
        self.settings = settings
        self.packed = view.flags.use_remove_padding
        layout = view.layout
        if self.packed:
            self.plan = RowPlan.make(layout.total_nnz, bucket=settings.pad_to_length,
                                     sp_size=settings.sp_size, sp_rank=settings.sp_rank)
            pad_size = _require_arg(output_args, "pad_size")
            if int(pad_size) != self.plan.pad_size:
                raise ShapeError(f"output_args['pad_size'] is {pad_size}, the engine settings give "
                                 f"{self.plan.pad_size} for total_nnz={layout.total_nnz}")
            self.rows = self.plan.local_len
        else:
            self.rows = layout.total_nnz

    def check(self, tensor: Any, key: str, trailing: int) -> torch.Tensor:
        """``tensor`` if it has the model-output shape of this mode, else raise."""
        layout = self.view.layout
        if not isinstance(tensor, torch.Tensor) or tensor.is_nested:
            raise ShapeError(f"model output {key!r} must be a dense tensor, got {type(tensor).__name__}")
        want = (1, self.rows) if self.packed else (layout.batch_size, layout.max_seq_len)
        if tensor.dim() != 2 + trailing or tuple(tensor.shape[:2]) != want:
            mode = "packed" if self.packed else "padded"
            raise ShapeError(f"model output {key!r} has shape {tuple(tensor.shape)}; the {mode} mode "
                             f"expects {want + ('*',) * trailing}")
        return tensor

    def rows_between(self, tensor: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Real-token rows ``start:stop`` (packed order) of a checked model output: a view when packed."""
        if self.packed:
            return tensor[0, start:stop]
        layout = self.view.layout
        flat = tensor.reshape(layout.batch_size * layout.max_seq_len, *tensor.shape[2:])
        return flat.index_select(0, layout.dense_index[start:stop])

    def select(self, tensor: Any, key: str, trailing: int) -> torch.Tensor:
        """All real-token rows of a (small) model output: ``(rows, *rest)``."""
        tensor = self.check(tensor, key, trailing)
        if self.packed:
            return tensor[0]
        return padded_to_jagged(tensor, self.view.layout.offsets, self.rows)

    def finish(self, rows: torch.Tensor, key: str) -> torch.Tensor:
        """Per-token ``rows`` (this rank's, or the batch's) as a nested tensor over full sequences."""
        if rows.shape[0] != self.rows:
            raise ShapeError(f"{key!r} has {rows.shape[0]} tokens (shape {tuple(rows.shape)}), "
                             f"expected {self.rows}")
        if self.packed:
            rows = self.plan.unshard(rows, self.settings.all_gather, key)
        return nested_from_values(rows, self.view.layout, key)

    def temperature(self, output_args: Mapping[str, Any]) -> torch.Tensor:
        if self.packed:
            temps = _require_arg(output_args, "temperature_rmpad")
        else:
            temps = self.view.layout.per_token(_require_arg(output_args, "temperature"))
        if temps.shape != (self.rows,):
            raise ShapeError(f"temperature per token has shape {tuple(temps.shape)}, expected ({self.rows},)")
        return temps

    def labels(self, output_args: Mapping[str, Any]) -> torch.Tensor:
        labels = _require_arg(output_args, "input_ids_rmpad_rolled")
        if labels.shape != (self.rows,):
            raise ShapeError(f"output_args['input_ids_rmpad_rolled'] has shape {tuple(labels.shape)}, "
                             f"expected ({self.rows},)")
        return labels


def _check_vocab(labels: torch.Tensor, vocab: int) -> None:
    lo, hi = torch.stack([labels.min(), labels.max()]).tolist()
    if lo < 0 or hi >= vocab:
        raise ShapeError(f"logits have vocab size {vocab} but the labels range over [{lo}, {hi}]")


def _processor_outputs(processor: LogitsProcessor | None, scaled: torch.Tensor, micro_batch: TensorDictBase,
                       route: TokenRoute, taken: set[str]) -> dict[str, torch.Tensor]:
    if processor is None:
        raise UnsupportedConfigError("distillation_use_topk is set but no logits_processor_func was given")
    produced = processor(student_logits=scaled.unsqueeze(0), data=micro_batch)
    if not isinstance(produced, Mapping):
        raise ShapeError(f"logits_processor_func must return a dict of tensors, got {type(produced).__name__}")
    result = {}
    for key, value in produced.items():
        if key in taken:
            raise UnsupportedConfigError(f"logits_processor_func output {key!r} collides with an engine output")
        if not isinstance(value, torch.Tensor) or tuple(value.shape) not in ((1, route.rows), (route.rows,)):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ShapeError(f"logits_processor_func output {key!r} has shape {shape}, "
                             f"expected (1, {route.rows})")
        result[key] = route.finish(value.reshape(route.rows), key)
    return result


def prepare_model_outputs(output: Any, output_args: Mapping[str, Any], micro_batch: TensorDictBase,
                          logits_processor_func: LogitsProcessor | None = None,
                          settings: EngineSettings = EngineSettings()) -> dict[str, torch.Tensor]:
    """Per-token ``log_probs``/``entropy``/``sum_pi_squared``/distillation keys, nested over full sequences."""
    view = MicroBatchView.of(micro_batch)
    flags = view.flags
    route = TokenRoute(view, output_args, settings)
    result: dict[str, torch.Tensor] = {}
    logits = _field(output, "logits")

    if flags.use_fused_kernels:
        wanted = [] if flags.distillation_only else ["log_probs"]
        wanted += ["entropy"] if flags.calculate_entropy else []
        for key in wanted:
            result[key] = route.finish(route.select(_field(output, key), key, 0).float(), key)
        needs_logits = flags.calculate_sum_pi_squared or flags.distillation_use_topk
        if not needs_logits:
            return result
        if logits is None:
            raise UnsupportedConfigError(
                "calculate_sum_pi_squared / distillation_use_topk need output.logits, which fused kernels omit")

    logits = route.check(logits, "logits", 1)
    temperature = route.temperature(output_args).to(logits.device).clamp(min=TEMPERATURE_FLOOR)
    want_log_probs = not flags.distillation_only and not flags.use_fused_kernels
    labels = route.labels(output_args) if want_log_probs else None
    if labels is not None:
        _check_vocab(labels, logits.shape[-1])
    scaled = None
    if flags.distillation_use_topk:  # the processor takes every scaled row at once
        scaled = route.rows_between(logits, 0, route.rows).float() / temperature.unsqueeze(-1)
        rows = lambda start, stop: scaled[start:stop]  # noqa: E731
    else:  # chunk by chunk: only chunk-sized float32 temporaries, never a full copy of the logits
        rows = lambda start, stop: (  # noqa: E731
            route.rows_between(logits, start, stop).float() / temperature[start:stop].unsqueeze(-1))
    stats = token_statistics(
        rows, route.rows, logits.shape[-1], labels,
        entropy=flags.calculate_entropy and not flags.use_fused_kernels,
        sum_pi_squared=flags.calculate_sum_pi_squared,
        chunk_size=settings.entropy_chunk_size)
    result.update({key: route.finish(value, key) for key, value in stats.items()})
    if scaled is not None:
        result.update(_processor_outputs(logits_processor_func, scaled, micro_batch, route, set(result)))
    return result


def prepare_value_outputs(output: Any, output_args: Mapping[str, Any], micro_batch: TensorDictBase,
                          settings: EngineSettings = EngineSettings()) -> dict[str, torch.Tensor]:
    """``{"values": nested (B, j)}`` from a value head's ``(…, 1)`` logits."""
    view = MicroBatchView.of(micro_batch)
    route = TokenRoute(view, output_args, settings)
    rows = route.select(_field(output, "logits"), "logits", 1)
    if rows.shape[-1] != 1:
        raise ShapeError(f"value head logits must end in 1, got shape {tuple(rows.shape)}")
    return {"values": route.finish(rows.squeeze(-1).float(), "values")}
