"""Running the catalogue: hypothesis driving each invariant x mode against an engine (:mod:`.runner`:
outcomes, known-failure bookkeeping), the hypothesis profiles (:mod:`.profiles`), the example database
(:mod:`.database`) and the engine registry, names to engines (:mod:`.registry`). May import every layer
below (protocol, truth, cases, engines, planted, execute, invariants).
"""
