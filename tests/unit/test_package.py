"""The package imports, reports its version, and the native module matches it."""

import subprocess
import sys

import dualpath


def test_version_is_semver_like():
    parts = dualpath.__version__.split(".")
    assert len(parts) == 3 and all(p.isdigit() for p in parts)


def test_native_module_embeds_package_version():
    from dualpath import _native

    assert _native.NATIVE_VERSION == dualpath.__version__


def test_native_version_mismatch_refuses_to_load(tmp_path):
    # Simulate a stale .so: make the package claim another version and import again.
    code = (
        "import dualpath._version as v; v.__version__ = '9.9.9'\n"
        "try:\n"
        "    import dualpath._native\n"
        "except ImportError as e:\n"
        "    print('refused:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "refused:" in out.stdout and "9.9.9" in out.stdout and "stale" in out.stdout
