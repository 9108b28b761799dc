"""TRL 1.16 under test: its logits API (``--engine trl``, :mod:`.adapter`), GRPO's fused LM head
(``--engine trl-fused``, :mod:`.fused`) and their known-failure records and profile (:mod:`.records`)."""
