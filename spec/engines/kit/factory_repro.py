"""A user's engine in a standalone reproducer (:meth:`spec.engines.factory.FactoryEngine.repro_snippet`): imported
from its own module and called as :meth:`~spec.engines.factory.FactoryEngine.make` calls it. The engine block a
file carries, vendored from this module after the two lines that import the module and take its attribute."""

from __future__ import annotations

#: what the file binds for this module: the user's module and what it names (an engine object, class or factory)
BOUND = ("_MODULE", "_TARGET")


def make_engine(head, **settings):
    settings = {k: v for k, v in settings.items() if not (k == "sp_size" and v == 1)}
    if hasattr(_TARGET, "prepare_model_inputs") and not isinstance(_TARGET, type):  # an engine object
        return _TARGET
    if isinstance(_TARGET, type):  # an engine class
        return _TARGET(**settings)
    return _TARGET(head=head, **settings)


def helper(name):
    try:
        probe = make_engine("lm")
    except Exception:  # noqa: BLE001
        probe = None
    return getattr(probe, name, None) or getattr(_MODULE, name, None)
