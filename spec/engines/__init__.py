"""Engines under test: one adapter per engine, mapping it onto :mod:`spec.protocol`, with every known
failure of that engine recorded beside it. :mod:`.impl` (this project), :mod:`.verl` (verl's FSDP engines)
and :mod:`.verl_records` (records shared by verl's engines), :mod:`.veomni`, :mod:`.torchtitan`,
:mod:`.automodel`, :mod:`.megatron` with the reference packer :mod:`.megatron_packing`; :mod:`.native`
(engines with their own methods), :mod:`.factory` (``module:attr`` engines) and :mod:`.stubs` (heavy
module-level imports stubbed), :mod:`.kit` and :mod:`.hf_batch` (the adapter kit). No engine code is copied, no engine patched, every capability probed. May
import protocol, truth and cases; the registry of names is :mod:`spec.run.registry`.
"""
