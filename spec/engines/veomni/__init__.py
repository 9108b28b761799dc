"""verl's VeOmni engine under test (``--engine verl-veomni``): its adapter (:mod:`.adapter`)."""
