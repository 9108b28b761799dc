"""SkyRL under test: skyrl-train 0.3.1 and skyrl 0.4.0's ``HFModelWrapper.forward`` (``--engine skyrl-train``,
``--engine skyrl``): their adapter (:mod:`.adapter`) and their known-failure records and profiles (:mod:`.records`)."""
