"""verl's TorchTitan engine under test (``--engine verl-torchtitan``): its adapter and records (:mod:`.adapter`)."""
