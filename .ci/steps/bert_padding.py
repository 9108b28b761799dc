"""Install flash-attn 2.8.3's pure-torch bert_padding.py as the module ``flash_attn_bert_padding`` in this venv.

OpenRLHF's packed path (openrlhf.models.ring_attn_utils) runs flash-attn's unpad_input/pad_input/index_first_axis;
flash-attn itself needs CUDA to build. pip fetches the sdist (no build: FLASH_ATTENTION_SKIP_CUDA_BUILD, metadata
only) and this copies that one file out of it, unchanged, into site-packages. Nothing is committed.
"""

import os
import pathlib
import subprocess
import sys
import sysconfig
import tarfile
import tempfile

VERSION = "2.8.3"

with tempfile.TemporaryDirectory() as tmp:
    env = {**os.environ, "FLASH_ATTENTION_SKIP_CUDA_BUILD": "TRUE"}
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                    "--no-build-isolation", f"flash-attn=={VERSION}", "-d", tmp], check=True, env=env)
    (sdist,) = pathlib.Path(tmp).glob("flash_attn-*.tar.gz")
    with tarfile.open(sdist) as archive:
        source = archive.extractfile(f"flash_attn-{VERSION}/flash_attn/bert_padding.py").read()
target = pathlib.Path(sysconfig.get_paths()["purelib"]) / "flash_attn_bert_padding.py"
target.write_bytes(source)
print(f"flash-attn {VERSION} bert_padding.py -> {target}")
