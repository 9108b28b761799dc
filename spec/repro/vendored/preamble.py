"""The imports an engine-case reproducer and the suite module beside it open with (:mod:`spec.repro.templates`):
what the runtime (:mod:`spec.repro.runtime`) and the suite's pieces written out read. Vendored first, its
``from __future__`` import kept."""

from __future__ import annotations

import contextlib  # noqa: F401
import math  # noqa: F401
import sys  # noqa: F401
import threading  # noqa: F401
import traceback  # noqa: F401
from enum import Enum  # noqa: F401
from pathlib import Path  # noqa: F401
from types import SimpleNamespace  # noqa: F401

import numpy as np  # noqa: F401
import torch  # noqa: F401
from tensordict import TensorDict  # noqa: F401

#: what the file binds for this module: none
BOUND = ()
