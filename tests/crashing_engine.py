"""An engine whose process dies (a segfault) in ``prepare_model_inputs`` of a padded batch: for
tests/test_parallel.py, where the worker running it must be reported, not hang the run."""

import faulthandler

import impl


class CrashOnPadded(impl.LMHeadEngine):
    def prepare_model_inputs(self, micro_batch, *args, **kwargs):
        if not micro_batch["use_remove_padding"]:
            faulthandler._sigsegv()  # the interpreter dies here, as an engine's native code might
        return super().prepare_model_inputs(micro_batch, *args, **kwargs)
