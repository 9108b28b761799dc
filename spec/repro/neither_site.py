"""A ``sitecustomize`` that makes neither ``spec`` nor ``impl`` importable: :mod:`.measure` copies this file as
``sitecustomize.py`` onto the ``PYTHONPATH`` of a reproducer that imports neither (its engine written out,
spec/repro/engine_source.py), so that it runs, and the ranks it starts run, with neither importable. Never imported
by the suite (it would hide the suite from itself)."""

import sys

sys.modules["spec"] = None
sys.modules["impl"] = None
