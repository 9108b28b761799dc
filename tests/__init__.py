"""The suite's tests, a regular package: verl and OpenRLHF install a top-level ``tests`` package of their own into
site-packages, and a regular package there wins over a namespace directory here, whatever the order of sys.path.
So ``--engine tests.factory_engine:make_engine`` (and every ``tests.*`` engine the tests load by name) would not
import in those libraries' venvs without this file."""
