"""The invariant catalogue: every rule of the contract, each with a stable ID, in one place.

``CATALOGUE`` maps IDs to :class:`InvariantInfo`. The checks live in the modules
below, grouped by what they look at. May import protocol, truth, cases and execute (a check re-runs a case
through :mod:`spec.execute`); never an engine's adapter, the runner or the registry.
"""

from . import batch, dense, inputs, outputs, slicing  # noqa: F401 - registers the checks
from . import context  # noqa: F401 - the autograd context (grad, no_grad, inference_mode)
from . import dropin  # noqa: F401 - registers the drop-in checks (issue 15)
from . import megatron  # noqa: F401 - Megatron-style packing (needs the "packing" feature)
from . import megatron_media  # noqa: F401 - a vision-language micro-batch through Megatron-style packing
from . import megatron_routes  # noqa: F401 - router replay through Megatron-style packing
from . import ranks  # noqa: F401 - the real-rank checks (spec/execute/ranks.py)
from . import settings  # noqa: F401 - flags, engine settings and slice dtypes (issue 10: mutation survivors)
from . import state  # noqa: F401 - an engine object kept across micro-batches
from . import microbatch  # noqa: F401 - the micro-batch layer (prepare_micro_batches and its utilities)
from . import microbatch_trainer  # noqa: F401 - the layer as a trainer calls it (balance, training step, padded)
from . import media  # noqa: F401 - images and videos (multi_modal_inputs)
from . import degenerate  # noqa: F401 - degenerate inputs real runs produce (a zero-length response)
from . import step  # noqa: F401 - the whole training step: cut, loss aggregation, gradient (issue 49)
from . import routes  # noqa: F401 - an MoE rollout's routed experts, collated for router replay
from .core import CATALOGUE, Ctx, InvariantInfo

__all__ = ["CATALOGUE", "Ctx", "InvariantInfo"]
