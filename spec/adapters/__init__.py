"""Adapters: each maps one engine onto the engine protocol (:mod:`spec.protocol`).

Built like :mod:`spec.verl_engine` (verl's FSDP engine): no engine code copied, the engine not
patched, heavy modules stubbed only where the engine imports them at module level and they do not
import here (:mod:`spec.adapters.stubs`), every capability probed.
"""
