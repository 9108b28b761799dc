"""Engines under test: one folder per engine, holding its adapter (mapping it onto :mod:`spec.protocol`), every
known failure of that engine recorded beside it, and its CI step (``ci*.sh``, found by .ci/steps.sh; impl's steps are
the core ones): :mod:`.impl` (this project), :mod:`.verl` (verl's FSDP engine, the records, mutants and micro-batch
layer records verl's engines share, the base of its native engines), :mod:`.veomni`, :mod:`.torchtitan`,
:mod:`.automodel`, :mod:`.megatron` (verl's other engines), :mod:`.trl` (TRL's logits API and fused head),
:mod:`.openrlhf`, :mod:`.skyrl` (skyrl-train and skyrl); :mod:`.kit`, the adapter kit every adapter may build on (a
third party's engine class, strict stubs of heavy imports, Hugging Face batches, ``module:attr`` engines). No engine
code is copied, no engine patched, every capability probed. May import protocol, truth and cases; the registry of
names is :mod:`spec.run.registry`.
"""
