"""Mutation testing of ``impl/`` with mutmut: ``python -m mutation`` (see docs/mutation.md)."""
