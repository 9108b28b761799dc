"""verl's FSDP engine under test (``--engine verl``), and what verl's other engines share with it: the adapter
(:mod:`.adapter`), the records shared by verl's engines (:mod:`.records`), the mutants no input tells from verl's code
(:mod:`.mutants`), the micro-batch layer's records (:mod:`.microbatch_records`) and the base of verl's native engines,
TorchTitan and Automodel (:mod:`.native`)."""
