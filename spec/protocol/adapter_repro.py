"""The default engine block of a standalone reproducer (:meth:`spec.protocol.engine.EngineUnderTest.repro_snippet`):
the engine under test rebuilt from its recipe by import, built and read through the adapter's own views. Vendored
after the two lines that import the recipe's builder and build the adapter's engine."""

from __future__ import annotations

#: what the file binds for this module: the adapter's engine, built from its recipe
BOUND = ("_ENGINE",)


def make_engine(head, **settings):
    return _ENGINE.make(head, **settings)


def helper(name):
    return _ENGINE.helper(name)


def view_inputs(model_inputs, output_args):
    view = _ENGINE.view_inputs(model_inputs, output_args)
    return {k: v for k, v in vars(view).items() if k != 'extra'}


def view_outputs(outputs):
    return _ENGINE.view_outputs(outputs).per_sequence


def view_recorded_routes(outputs):
    return _ENGINE.view_outputs(outputs).routes


def logits_processor(case, sp_size, sp_rank):
    return _ENGINE.logits_processor(case, sp_size, sp_rank)
