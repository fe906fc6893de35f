"""Builds ckstore's one compiled extension, the byte-plane kernels (``ckstore/format/_planes.c``),
when a wheel is built (an editable install builds it in place, next to its source).

The extension is optional: without a C compiler the wheel is pure Python and ckstore splits and
merges byte planes with numpy (``ckstore.format.planes``), the same bytes, several times slower.
``CKSTORE_EXTENSION`` chooses: ``auto`` (the default: build, or warn and go on without it),
``require`` (a failed build fails the install; CI sets it) or ``skip`` (build nothing).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

try:
    from hatchling.builders.hooks.plugin.interface import BuildHookInterface
except ImportError:  # imported for compile_extension alone (benchmarks/bench_revisions.py)
    BuildHookInterface = object

SOURCE = "ckstore/format/_planes.c"
MODULE = "ckstore.format._planes"


class PlanesBuildHook(BuildHookInterface):  # type: ignore[misc]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        mode = os.environ.get("CKSTORE_EXTENSION", "auto")
        if mode not in ("auto", "require", "skip"):
            raise ValueError(f"CKSTORE_EXTENSION must be auto, require or skip, not {mode!r}")
        if mode == "skip":
            return
        self._temp = tempfile.mkdtemp(prefix="ckstore-build-")
        try:
            built = compile_extension(Path(self.root), Path(self._temp), in_place=version == "editable")
        except Exception as e:  # noqa: BLE001 - no compiler, no Python headers: go on without it
            if mode == "require":
                raise
            self.app.display_warning(
                f"ckstore: the byte-plane kernels were not compiled ({type(e).__name__}: {e}); "
                "ckstore will use numpy for them (slower checkouts and commits of float tensors)"
            )
            return
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        if version != "editable":  # (an editable install imports it from the source tree)
            build_data["force_include"][str(built)] = str(Path(*MODULE.split(".")[:-1], built.name))

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        temp = getattr(self, "_temp", None)
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)


def compile_extension(root: Path, temp: Path, *, in_place: bool) -> Path:
    """Compile the extension with setuptools' ``build_ext`` (the platform's compiler and flags);
    returns the built module's path: under ``temp``, or next to its source ``in_place``."""
    from setuptools import Distribution, Extension

    unix = sys.platform != "win32"
    ext = Extension(MODULE, [SOURCE], extra_compile_args=["-O3", "-std=c99"] if unix else ["/O2"])
    dist = Distribution({"name": "ckstore", "ext_modules": [ext]})
    cmd = dist.get_command_obj("build_ext")
    cmd.inplace = in_place
    cmd.build_lib = str(temp / "lib")
    cmd.build_temp = str(temp / "obj")
    here = os.getcwd()
    os.chdir(root)  # setuptools places in-place builds by package folder, from the current one
    try:
        cmd.ensure_finalized()
        cmd.run()
        return (root / cmd.get_ext_fullpath(MODULE)).resolve()
    finally:
        os.chdir(here)
