"""This project's engine (``impl/``) under test: its adapter (:mod:`.adapter`)."""
