"""Patch the GPU packages' extracted sdists for CUDA 13, in place (idempotent).

One step shared by the device check (scripts/gpu_check.sh) and its rehearsal on a machine without a
GPU (scripts/gpu_build_check.sh, `make gpu-build-check`), so both compile the same sources.

    python scripts/patch_gpu_sdists.py BUILD_DIR
    export CPATH=$(python scripts/patch_gpu_sdists.py --cuda-includes)

BUILD_DIR holds the extracted sdists (megablocks-0.10.0/, grouped_gemm-0.3.0/, ...). A package
that is not there is reported and skipped: the build that needs it then fails with its own error.
"""

import glob
import os
import re
import site
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Patch:
    """One regex substitution in one file of an extracted sdist."""

    path: str
    """The file, relative to BUILD_DIR."""
    pattern: str
    """What to replace (a regex that no longer matches once patched)."""
    replacement: str
    """Its replacement (re.sub syntax)."""
    why: str
    """One line: the compiler error it fixes."""


PATCHES = (
    # NOTE: CUDA 13's CUB (CCCL 3) dropped DeviceScan's debug_synchronous argument.
    Patch(
        "megablocks-0.10.0/csrc/cumsum.h",
        r",\s*debug_synchronous\)\);",
        "));",
        "CUB 3 DeviceScan::*Sum has no debug_synchronous argument",
    ),
)


def apply(build_dir: Path, patch: Patch) -> str:
    """Apply ``patch`` under ``build_dir``; return one line saying what happened."""
    path = build_dir / patch.path
    if not path.is_file():
        return f"skipped {patch.path}: not there"
    text = path.read_text()
    patched, count = re.subn(patch.pattern, patch.replacement, text)
    path.write_text(patched)
    return f"patched {patch.path}: {count} place(s) ({patch.why})"


def cuda_includes() -> str:
    """The include folders of the CUDA wheels beside torch, joined by ``:`` (for CPATH).

    NOTE: torch's CUDA headers include cusparse.h and cublas_v2.h, which live in these wheels
    (nvidia/cu13/include for torch 2.11), not in a toolkit that has only nvcc and the runtime.
    """
    roots = [*site.getsitepackages(), site.getusersitepackages()]
    pattern = os.path.join("nvidia", "**", "include")
    return ":".join(sorted({d for root in roots for d in glob.glob(os.path.join(root, pattern), recursive=True)}))


def main(argv: list[str]) -> int:
    """Apply every patch under the one BUILD_DIR argument, or print :func:`cuda_includes`."""
    if argv == ["--cuda-includes"]:
        print(cuda_includes())
        return 0
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print(
            "usage: python scripts/patch_gpu_sdists.py BUILD_DIR (a folder of extracted sdists) | --cuda-includes",
            file=sys.stderr,
        )
        return 2
    for patch in PATCHES:
        print(apply(Path(argv[0]), patch))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
