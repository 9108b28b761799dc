"""verl's Megatron packing under test (``--engine verl-megatron``): its adapter and records (:mod:`.adapter`)."""
