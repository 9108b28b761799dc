"""The reference truth: the contract's structural rules written once (:mod:`.rules`), the stand-in causal
model that honours masks and packed boundaries (:mod:`.toy_model`), and the per-sequence float64 oracle with
its per-token tolerances (:mod:`.oracle`). May import :mod:`spec.protocol` only; reads cases by their fields.
"""
