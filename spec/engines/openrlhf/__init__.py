"""OpenRLHF 0.11.2's ``Actor.forward`` under test (``--engine openrlhf``): its adapter (:mod:`.adapter`) and its
known-failure records and profile (:mod:`.records`)."""
