"""Cases: the structure of a drawn test case (:mod:`.structure`: lengths, splits, flags, a seed; no
tensors), the hypothesis strategies that draw it (:mod:`.strategies`, :mod:`.dropin` for the padding
helpers), and materialization, the tensors a case's seed makes (:mod:`.materialize`). May import
:mod:`spec.protocol` and :mod:`spec.truth`.
"""

from .structure import CONTEXTS, DISTILLATION_KEYS, LOGITS_DTYPES, TEMPERATURE_FLOOR, DenseCase, EngineCase

__all__ = ["CONTEXTS", "EngineCase", "DenseCase", "DISTILLATION_KEYS", "LOGITS_DTYPES", "TEMPERATURE_FLOOR"]
