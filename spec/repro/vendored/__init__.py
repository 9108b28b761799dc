"""The code a reproducer carries: real modules whose source the writer vendors into the files it writes
(:func:`spec.protocol.vendor.source`), so that a reproducer runs what this project tests, and no program is kept in a
string. Each imports only the standard library, numpy, torch and tensordict (``tests/test_vendored.py``), reads no
name but its own, a builtin's or one it declares in ``BOUND`` (what the file binds before it: its case, the engine's
functions), and does nothing when imported.
"""
