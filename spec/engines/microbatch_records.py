"""Known failures of verl's micro-batch layer (``INV-MB-*``), as precise records.

Keyed by verl version (``"*"``: every version probed so far); each record names the cases it applies to (a
:class:`spec.protocol.known.When` on the :class:`spec.cases.microbatch.MiniBatchCase`) and how it fails, with the upstream
issue where one is known. docs/verl-conformance.md ("The micro-batch layer") has a minimal counterexample for each.
"""

from __future__ import annotations

from ..protocol.known import KnownFailure, When

__all__ = ["MICROBATCH_RECORDS"]

MICROBATCH_RECORDS: dict[str, tuple[KnownFailure, ...]] = {"*": ()}
