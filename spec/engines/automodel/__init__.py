"""verl's Automodel (NeMo) engine under test (``--engine verl-automodel``): its adapter and records
(:mod:`.adapter`)."""
