"""Importing the command line and the RL loop must not load `triton.language`.

Triton fixes at import whether its standard-library functions are compiled or interpreted, and the
CPU kernel tests switch it to the interpreter (`TRITON_INTERPRET=1`) before their first kernel import;
a module that pulled in transformers' modeling code (which loads `triton.language`) at import time
broke every interpreter test collected after it."""

import subprocess
import sys


def test_cli_and_loop_imports_leave_triton_language_unloaded():
    code = "import sys, kv4rl.cli, kv4rl.loop; print('triton.language' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
