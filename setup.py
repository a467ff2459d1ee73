"""Build glue: the cffi extension (API mode) and the generated gRPC code.

Metadata lives in pyproject.toml. The extension is compiled from csrc/ against
libibverbs by dualpath/_native/build.py; gRPC stubs are generated from proto/ into
dualpath/v1/ by tools/gen_proto.py (never committed).
"""

import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithProto(build_py):
    def run(self):
        subprocess.check_call([sys.executable, str(ROOT / "tools" / "gen_proto.py")])
        # The package list was found before the stubs existed (a fresh clone, an sdist):
        # without this the wheel lacks dualpath.v1.
        if "dualpath.v1" not in self.packages:
            self.packages.append("dualpath.v1")
        super().run()


setup(
    cffi_modules=["dualpath/_native/build.py:ffibuilder"],
    cmdclass={"build_py": BuildPyWithProto},
)
