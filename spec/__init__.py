"""The property-based suite for LLM RL engines' input/output preparation.

Subpackages by job, each importing only those below it (``tests/test_layering.py`` enforces the table):

============  ====================================================================================
layer         holds
============  ====================================================================================
protocol      what an engine under test implements and declares (features, views, known-failure records)
truth         the reference truth: the contract's structural rules, the stand-in model, the float64 oracle
cases         case structure, hypothesis strategies, materialization (tensors from a case's seed)
engines       the adapters of real engines (impl, verl's five families) with their known-failure records
planted       planted bugs and harmless engines: what the suite must reject and must accept
execute       one case end to end through an engine (in process or on real ranks), who raised what
invariants    the catalogue: one check per consumer-visible rule, with an ID
run           hypothesis driving the catalogue (runner), profiles, the example database, the registry
faces         ``python -m spec`` (__main__), the report, fuzz campaigns, detection, the pytest plugin
============  ====================================================================================
"""
