"""The shared-memory regions of our servers: named after their owner, private to the server's
user, and removed once their owner is gone.

Every model instance's stub shares a region in ``/dev/shm`` with tritonserver (and the door one
with Triton for large tensors). A stub or server killed hard leaves its region behind (1 MiB or
as large as it grew), a launcher killed hard leaves them all. Each name carries its owner (the
pid and start time of the process that made the server or the door), so:

* the launcher removes exactly its server's regions when it stops or restarts it;
* every start removes the regions whose owner has died and that no process still maps, and no
  others (a live server's on the same host, another user's, or a name of another form).

The Python backend creates its regions 0644 (boost widens them with ``fchmod`` whatever the
umask): they hold request data. ``private_regions`` gives the server's process, and every stub
it starts, a umask of 077 and a seccomp filter under which ``fchmod`` does nothing (EPERM, which
boost ignores), so they stay 0600.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
import secrets
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIX_HEAD = "neopp_shm_"
OWNER = re.compile(r"^(\d+)-(\d+)$")
# The first size is allocated in /dev/shm for every instance at load, so it stays small (small
# inputs and one encoded image fit). A realistic request, two KV prefixes of 36 layers x 2 x 300
# tokens x 8 heads x 128 x 2 bytes (about 44 MB each), grows it in 6 steps of 16 MiB; the HTTP
# front's 128 MiB body limit bounds what one HTTP request can make it grow to.
DEFAULT_REGION_BYTES = 8 * 1024 * 1024
GROWTH_BYTES = 16 * 1024 * 1024
# seccomp: (architecture as the kernel names it, fchmod's system call number) per machine
SECCOMP_ARCH = {"x86_64": (0xC000003E, 91), "aarch64": (0xC00000B7, 52)}


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks after boot), which a reused pid does not share."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])


def owner_tag(pid: int | None = None) -> str:
    """``<pid>-<start time>`` of the owner (this process by default)."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}-{_start_time(pid) or 0}"


def owner_alive(tag: str) -> bool:
    match = OWNER.match(tag)
    return match is None or _start_time(int(match.group(1))) == int(match.group(2))


def new_prefix() -> str:
    """The owner and 32 random bits: two servers' prefixes never match each other's regions."""
    return f"{PREFIX_HEAD}{owner_tag()}_{secrets.token_hex(4)}_"


def backend_args(prefix: str, default_bytes: int | None = None, growth_bytes: int | None = None) -> list[str]:
    """tritonserver flags for the Python backend: region prefix, and first size / growth step if given."""
    args = [f"--backend-config=python,shm-region-prefix-name={prefix}"]
    if default_bytes:
        args.append(f"--backend-config=python,shm-default-byte-size={default_bytes}")
    if growth_bytes:
        args.append(f"--backend-config=python,shm-growth-byte-size={growth_bytes}")
    return args


def regions(prefix: str, shm_dir: Path = SHM_DIR) -> list[Path]:
    """Region files of the server with ``prefix`` that exist now."""
    if not prefix.startswith(PREFIX_HEAD) or not shm_dir.is_dir():
        return []
    return sorted(p for p in shm_dir.iterdir() if p.name.startswith(prefix))


def remove_regions(prefix: str, shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink the server's regions (call only once its processes are gone); returns their names."""
    removed = []
    for path in regions(prefix, shm_dir):
        try:
            path.unlink()
            removed.append(path.name)
        except FileNotFoundError:
            continue
    return removed


def _mapped(shm_dir: Path) -> set[str]:
    """Names of ``shm_dir`` files some process maps now (those whose maps we may read)."""
    names, marker = set(), f" {shm_dir}/"
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "maps").read_text()
        except OSError:
            continue
        names.update(line.split(marker, 1)[1].split(" ")[0] for line in text.splitlines() if marker in line)
    return names


def remove_orphans(heads: Iterable[str], shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink the regions named ``<head><owner>_...`` whose owner has died and that no process
    maps; returns their names."""
    if not shm_dir.is_dir():
        return []
    heads = tuple(heads)
    dead = [p for p in shm_dir.iterdir() if p.name.startswith(heads)
            and not owner_alive(p.name[len(next(h for h in heads if p.name.startswith(h))):].split("_", 1)[0])]
    if not dead:
        return []
    in_use, removed = _mapped(shm_dir), []
    for path in dead:
        if path.name not in in_use:
            try:
                path.unlink()
                removed.append(path.name)
            except OSError:  # gone meanwhile, or another user's
                continue
    return removed


def private_regions() -> Callable[[], None]:
    """What the server's child runs before exec so that its regions, and its stubs', are 0600:
    umask 077, and (on x86-64 and aarch64 Linux) a seccomp filter that fails ``fchmod``. The
    filter is built here, in the parent; the child only installs it (a failure leaves the umask)."""
    machine = SECCOMP_ARCH.get(platform.machine())
    install = None
    if machine is not None:
        try:
            install = _seccomp_installer(*machine)
        except (OSError, AttributeError):  # no libc prctl: the umask alone
            install = None

    def child() -> None:
        os.umask(0o077)
        if install is not None:
            install()
    return child


def _seccomp_installer(arch: int, fchmod: int) -> Callable[[], None]:
    """A classic BPF program: for this architecture, ``fchmod`` returns EPERM; all else runs."""
    load, jump_eq, ret = 0x20, 0x15, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_RET|K
    allow, eperm = 0x7FFF0000, 0x00050000 | 1  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EPERM
    program = [(load, 0, 0, 4), (jump_eq, 0, 3, arch), (load, 0, 0, 0), (jump_eq, 0, 1, fchmod),
               (ret, 0, 0, eperm), (ret, 0, 0, allow)]
    code = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *op) for op in program))
    fprog = ctypes.create_string_buffer(struct.pack("HxxxxxxP", len(program), ctypes.addressof(code)))
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]

    def install(buffers: tuple = (code, fprog)) -> None:  # the buffers live as long as this function
        if prctl(38, 1, None, 0, 0) == 0:  # PR_SET_NO_NEW_PRIVS: what an unprivileged filter needs
            prctl(22, 2, ctypes.addressof(buffers[1]), 0, 0)  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
    return install
