"""A user's engine for the reproducer tests, importing nothing of the suite: a factory ``make_engine(head, **settings)``
(loaded as ``tests.repro_engines:wrong_keys``)."""

import torch

import impl


class _WrongKeys(impl.LMHeadEngine):
    """impl's LM head with log_probs and sum_pi_squared both off by one."""

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        out = super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)
        for key in ("log_probs", "sum_pi_squared"):
            if key in out:
                v = out[key]
                out[key] = torch.nested.nested_tensor_from_jagged(v.values() + 1.0, v.offsets())
        return out


def wrong_keys(head: str = "lm", **settings):
    return (_WrongKeys if head == "lm" else impl.ValueHeadEngine)(**settings)
