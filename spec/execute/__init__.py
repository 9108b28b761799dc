"""Execution: one case end to end through an engine (:mod:`.harness`: materialize, the engine's
``prepare_model_inputs``, the stand-in model with the padding poisoned, ``prepare_model_outputs``), the same
on real ranks joined by ``torch.distributed`` (:mod:`.ranks`, the worker side :mod:`.rank_worker`), and who
raised an exception, the engine or the suite (:mod:`.attribution`). May import protocol, truth, cases and
impl (the all-gather seam); never the engines' adapters: an engine arrives as an object or a recipe.
"""
