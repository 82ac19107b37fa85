"""Keys for tritonserver's restriction flags without putting them on its command line.

Triton 2.51 reads the keys of ``--http-restricted-api`` / ``--grpc-restricted-protocol`` only
from its arguments, and every local user can read a process's arguments
(``/proc/<pid>/cmdline``). So the arguments carry a marker per key (``@NEOPP_KEY_<n>@``, random
per server) and a small library loaded before tritonserver's ``main`` (``LD_PRELOAD``) reads the
keys from a pipe the launcher hands over, points ``argv`` at copies with the keys in place of the
markers, and leaves the original argument bytes (what ``/proc`` shows) as they were. It closes
the pipe and drops its own variables, so the stubs inherit neither. It fails closed: a marker
left unreplaced, or keys that cannot be read, end the process before ``main``.

The library is built with the host's C compiler into a private directory at each start; without
a compiler :func:`build` returns None and the keys go on the command line as before (the
launcher logs it, docs/security.md says what that exposes).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path

FD_ENV = "NEOPP_KEYS_FD"
SOURCE = r"""
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char *swap(const char *arg, const char *mark, const char *value) {
    const char *at = strstr(arg, mark);
    size_t head = (size_t)(at - arg), mlen = strlen(mark), vlen = strlen(value);
    char *out = malloc(strlen(arg) - mlen + vlen + 1);
    if (!out) _exit(71);
    memcpy(out, arg, head);
    memcpy(out + head, value, vlen);
    strcpy(out + head + vlen, at + mlen);
    return out;
}

__attribute__((constructor)) static void neopp_keys(int argc, char **argv, char **envp) {
    (void)envp;
    const char *fdtext = getenv("NEOPP_KEYS_FD");
    if (!fdtext) return;
    int fd = atoi(fdtext);
    static char buf[16384];
    size_t len = 0;
    ssize_t n;
    while (len < sizeof buf - 1 && (n = read(fd, buf + len, sizeof buf - 1 - len)) > 0) len += (size_t)n;
    close(fd);
    buf[len] = 0;
    if (len == 0) _exit(70);
    /* lines of "<mark> <key>" */
    for (char *line = buf, *next; line && *line; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = 0;
        char *space = strchr(line, ' ');
        if (!space) _exit(70);
        *space = 0;
        for (int i = 1; i < argc; i++)
            while (strstr(argv[i], line)) argv[i] = swap(argv[i], line, space + 1);
    }
    for (int i = 1; i < argc; i++)
        if (strstr(argv[i], "@NEOPP_KEY_")) _exit(70);
    memset(buf, 0, sizeof buf);
    unsetenv("NEOPP_KEYS_FD");
    unsetenv("LD_PRELOAD");
}
"""


def compiler() -> str | None:
    return next((found for name in ("cc", "gcc", "clang") if (found := shutil.which(name))), None)


def build(directory: Path) -> Path | None:
    """Compile the library into ``directory`` (private to this user); None without a compiler."""
    cc = compiler()
    if cc is None:
        return None
    source, library = directory / "neopp_keys.c", directory / "neopp_keys.so"
    source.write_text(SOURCE)
    done = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(library), str(source)],
                          capture_output=True, timeout=120)
    return library if done.returncode == 0 and library.exists() else None


class HiddenKeys:
    """Markers for the arguments, and the pipe that carries the keys to the library."""

    def __init__(self, library: Path) -> None:
        self.library = library
        self.values: dict[str, str] = {}
        self._read_fd: int | None = None

    def mark(self, key: str | None) -> str | None:
        """The marker that stands for ``key`` in an argument."""
        if key is None:
            return None
        marker = f"@NEOPP_KEY_{secrets.token_hex(8)}@"
        self.values[marker] = key
        return marker

    def env(self, env: dict[str, str]) -> dict[str, str]:
        """``env`` with the library preloaded and the pipe's descriptor named; opens the pipe."""
        read_fd, write_fd = os.pipe()
        payload = "".join(f"{marker} {key}\n" for marker, key in self.values.items()).encode()
        os.write(write_fd, payload)  # far below a pipe's buffer: never blocks
        os.close(write_fd)
        os.set_inheritable(read_fd, True)
        self._read_fd = read_fd
        return {**env, "LD_PRELOAD": str(self.library), FD_ENV: str(read_fd)}

    @property
    def pass_fds(self) -> tuple[int, ...]:
        return () if self._read_fd is None else (self._read_fd,)

    def started(self) -> None:
        """Close our end once the child has its copy."""
        if self._read_fd is not None:
            os.close(self._read_fd)
            self._read_fd = None


def private_build_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="neopp_keys_"))
