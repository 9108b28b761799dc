"""The protocol an engine under test implements (:mod:`.engine`) and the records of its known failures
(:mod:`.known`). Imports nothing of spec: every other layer builds on it.
"""

from .engine import (
    ENGINE_FEATURE,
    FLAG_DEFAULTS,
    HELPER_FEATURES,
    HELPERS,
    Capabilities,
    ConfigSwitch,
    EngineObject,
    EngineUnderTest,
    Feature,
    InputsView,
    OutputsView,
    HeadInput,
    OutputSpan,
    PaddedLayout,
    Precision,
    ReproSnippet,
    ShardLayout,
    action_view,
    completion_view,
    read_flags,
    response_view,
    sequences_from_responses,
    sequences_from_rows,
    verl_fsdp_view,
)
from .profile import DEFAULT_PROFILE, MODES, POSITIONS, Convention, EngineProfile
from .known import ALWAYS, KnownFailure, When, applicable, as_records, describe_records, matching

__all__ = ["Feature", "ShardLayout", "Capabilities", "EngineObject", "EngineUnderTest", "InputsView",
           "OutputsView", "Precision", "ConfigSwitch", "ReproSnippet", "verl_fsdp_view", "HELPERS", "HELPER_FEATURES",
           "ENGINE_FEATURE",
           "When", "ALWAYS", "KnownFailure", "applicable", "matching", "describe_records", "as_records",
           "PaddedLayout", "OutputSpan", "HeadInput", "response_view", "completion_view", "action_view",
           "sequences_from_responses", "sequences_from_rows", "read_flags", "FLAG_DEFAULTS",
           "EngineProfile", "Convention", "DEFAULT_PROFILE", "MODES", "POSITIONS"]
