"""Podman on the emulated hosts: an image made offline from this machine's own files (its
system libraries and tools, the running Python, a virtualenv with Ray and this checkout's
rlx as a wheel installs it), stored once; each host has its own container storage in its
private /tmp/ray tmpfs, as each node of a real cluster has its own disk, and reads the image
from the shared store."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

from rlx.launchers.ship import build_wheel

IMAGE = "localhost/rlx-test:offline"
# Big packages a `command:` job of rlx does not import (the trainer's, other backends').
HEAVY = [
    "torch", "triton", "vllm", "pyarrow", "llvmlite", "transformers", "pandas", "cv2",
    "opencv_python_headless.libs", "sympy", "mistral_common", "pulp", "matplotlib", "numba",
    "anthropic", "openai", "sky", "dstack", "nvidia", "tensorboard*", "datasets", "sqlalchemy",
    "fontTools", "pycountry", "rlx", "rlx-*", "__editable__*", "_editable_impl_rlx*",
    "moto", "cfnlint", "botocore", "boto3", "networkx", "tvm_ffi", "tokenizers", "asyncpg",
    "psycopg2*", "hf_xet", "azure", "llguidance", "trl", "peft", "pillow.libs", "PIL",
    "virtualenv", "pip",
]  # fmt: skip
# Big system files none of that runs (compilers' and graphics' libraries, static archives,
# tools of this machine's own), left out of the image: its import is hashing and unpacking,
# about a CPU-minute a gigabyte.
SYSTEM_HEAVY = [
    "usr/lib/x86_64-linux-gnu/libLLVM*", "usr/lib/x86_64-linux-gnu/*.a",
    "usr/lib/x86_64-linux-gnu/dri", "usr/lib/x86_64-linux-gnu/valgrind",
    "usr/lib/x86_64-linux-gnu/libz3*", "usr/lib/x86_64-linux-gnu/libx265*",
    "usr/lib/x86_64-linux-gnu/librsvg*", "usr/lib/x86_64-linux-gnu/perl",
    "usr/bin/node", "usr/bin/podman", "usr/bin/*lto-dump*", "usr/bin/shellcheck",
    "usr/bin/ctest", "usr/bin/cpack", "usr/bin/gdb", "usr/bin/perf",
]  # fmt: skip


def podman_unavailable_reason() -> str | None:
    for tool in ("podman", "runc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (run .ci/setup-system)"
    if not Path("/usr/libexec/podman/catatonit").exists():
        return "catatonit (podman's --init) is not installed (run .ci/setup-system)"
    return None


def write_config(root: Path, store: Path) -> dict[str, str]:
    """containers.conf and storage.conf for the hosts; the environment that selects them.
    The paths under /tmp/ray are each host's own (a tmpfs per host)."""
    nofile = 16384
    conf = root / "containers.conf"
    conf.write_text(
        "[containers]\n"
        # This machine may not raise rlimits (no CAP_SYS_RESOURCE): ask for what it has.
        f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc=32768:32768"]\n'
        "[engine]\n"
        # crun refuses a hybrid cgroup v1/v2 layout like this machine's; runc runs on it.
        'runtime = "runc"\n'
        'cgroup_manager = "cgroupfs"\n'
        'events_logger = "file"\n'
        'tmp_dir = "/tmp/ray/podman/tmp"\n'
    )
    storage = root / "storage.conf"
    storage.write_text(
        "[storage]\n"
        'driver = "overlay"\n'
        'graphroot = "/tmp/ray/podman/root"\n'
        'runroot = "/tmp/ray/podman/run"\n'
        "[storage.options]\n"
        f'additionalimagestores = ["{store}"]\n'
    )
    return {"CONTAINERS_CONF": str(conf), "CONTAINERS_STORAGE_CONF": str(storage)}


def python_parts(base: Path) -> list[str]:
    """What of the base interpreter the image needs, relative to /: its whole prefix where it
    has one of its own (a build under /opt or ~/.pyenv), else (the distribution's, prefix
    /usr, whose executable usr/bin brings) only its standard library: the archive must not
    hold /usr, nor any path twice."""
    if base != Path("/usr"):
        return [str(base.relative_to("/"))]
    return [str(Path(sysconfig.get_paths()["stdlib"]).relative_to("/"))]


def build_image(root: Path, store: Path) -> str:
    """Import the offline image into `store` (a podman graphroot); returns its name."""
    venv, base = Path(sys.prefix), Path(sys.base_prefix)
    site = Path(sysconfig.get_paths()["purelib"])
    stage = root / "stage"
    for empty in ("tmp", "proc", "dev", "sys", "run", "var/tmp"):
        (stage / empty).mkdir(parents=True, exist_ok=True)
    # rlx as installing its wheel lays it out, in a folder of its own that the virtualenv
    # reads through a .pth file (each path goes into the archive once); the virtualenv's
    # own `rlx` command runs it.
    with zipfile.ZipFile(build_wheel(root / "wheel")) as wheel:
        wheel.extractall(stage / "opt" / "rlx")
    pth = stage / site.relative_to("/") / "image-rlx.pth"
    pth.parent.mkdir(parents=True, exist_ok=True)
    pth.write_text("/opt/rlx\n")
    # The empty mount points and the .pth go in as single entries (no recursion): a
    # virtualenv under /tmp or /var would otherwise bring the same folders twice, which
    # podman import refuses ("duplicates of file paths not supported").
    single = ["tmp", "proc", "dev", "sys", "run", "var", "var/tmp", str(pth.relative_to(stage))]
    excludes = [f"--exclude={site.relative_to('/')}/{name}" for name in HEAVY]
    excludes += [f"--exclude={base.relative_to('/')}/lib/python3.*/{d}" for d in ("test",)]
    excludes += [f"--exclude={base.relative_to('/')}/lib/python3.*/site-packages"]
    excludes += [f"--exclude={pattern}" for pattern in SYSTEM_HEAVY]
    tarball = root / "rootfs.tar"
    parts = ["usr/bin", "usr/sbin", "usr/lib/x86_64-linux-gnu", "usr/lib64", "bin", "lib"]
    parts += ["lib64", "sbin", "etc", *python_parts(base), str(venv.relative_to("/"))]
    subprocess.run(
        [
            "tar",
            "-cf",
            str(tarball),
            *excludes,
            "-C",
            "/",
            *parts,
            "-C",
            str(stage),
            "opt",
            "--no-recursion",
            *single,
        ],
        check=True,
        timeout=600,
    )
    path = f"{venv}/bin:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
    runroot = tempfile.mkdtemp(prefix="rlxpm-", dir="/tmp")  # podman: at most 50 characters
    done = subprocess.run(
        ["podman", "--root", str(store), "--runroot", runroot, "import",
         "--change", f"ENV PATH={path}", str(tarball), IMAGE],
        timeout=600,
        capture_output=True,
        text=True,
    )  # fmt: skip
    shutil.rmtree(runroot, ignore_errors=True)
    if done.returncode != 0:
        raise RuntimeError(f"podman import failed: {done.stderr.strip()}")
    tarball.unlink()
    return IMAGE
