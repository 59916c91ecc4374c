"""Run a test file's Triton kernels under the interpreter (``TRITON_INTERPRET=1``, CPU) in a
subprocess: the file run as ``python FILE --interpret`` checks them and prints its marker. The
subprocess imports the cpmeta this process runs (a checkout without an install, too)::

    run_interpreted(__file__, "interpreter cases passed")
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import cpmeta


def run_interpreted(test_file: str, marker: str) -> None:
    """``test_file --interpret`` under the interpreter must exit 0 and print ``marker``."""
    here = str(Path(cpmeta.__file__).resolve().parents[1])
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, (here, os.environ.get("PYTHONPATH"))))}
    path = Path(test_file).resolve()
    proc = subprocess.run([sys.executable, str(path), "--interpret"], env=env, cwd=path.parent.parent,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert marker in proc.stdout
