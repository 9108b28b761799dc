"""A user's engine as the suite sees one: a factory ``make_engine(head, **settings)``.

Used by tests/test_cli.py to run ``python -m spec verify --engine tests.factory_engine:make_engine``.
"""

import impl
from impl import build_attention_mask_from_nested, no_padding_2_padding  # noqa: F401 - helpers the suite finds


def make_engine(head: str = "lm", **settings):
    return (impl.LMHeadEngine if head == "lm" else impl.ValueHeadEngine)(**settings)
