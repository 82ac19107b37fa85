"""Shared-memory regions go with their owner, against real servers: a killed owner's regions are
removed at the next start and a live owner's are kept, every region is 0600, and ``stop`` removes
exactly the regions of the server it started (a stub killed and reloaded, the server killed hard).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import tritonclient.grpc as grpcclient

from neopp.launcher.shm_regions import PREFIX_HEAD, SHM_DIR, owner_tag, regions
from neopp.launcher.tritonserver import TritonServer
from neopp.launcher.watchdog import force_reload
from neopp.procs import model_stubs, process_group_members
from testing import REPO as REPO_ROOT
from testing.faults import kill_own_stub, wait_for

MODEL = "neopp_dense"
OWNER = """
import sys
from neopp.launcher.tritonserver import TritonServer
server = TritonServer(sys.argv[1], log_path=sys.argv[2], extra_args=["--model-control-mode=explicit",
                      "--load-model=neopp_dense"]).start()
server.wait_ready(timeout=300)
print(server.process.pid, server.shm_prefix, flush=True)
sys.stdin.read()
"""


def _killed_owner(env: dict[str, str], log: Path) -> tuple[str, list[str]]:
    """A process that starts a server and is then killed with it (a launcher killed hard): the
    regions it leaves (its prefix and their names)."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(REPO_ROOT / "model_repository"), str(log)],
                             env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        server_pid, prefix = owner.stdout.readline().split()
        os.killpg(int(server_pid), signal.SIGKILL)  # first: nothing of it may clean up
        assert wait_for(lambda: not process_group_members(int(server_pid)), 30)
    finally:
        owner.kill()
        owner.wait(timeout=30)
    return prefix, [p.name for p in regions(prefix)]


def test_regions_are_private_and_go_with_their_owner(tiny_dense, tmp_path):
    """A killed owner's regions are removed at the next start (and a live owner's are not); a
    graceful stop lets Triton remove its regions itself; a stub killed, its model reloaded and then
    the server killed hard leave them all behind, and ``stop`` removes exactly those. Every region
    is 0600."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEOPP_CHECKPOINT")}
    env["NEOPP_CHECKPOINT"] = str(tiny_dense)
    prefix, orphans = _killed_owner(env, tmp_path / "owner.log")
    assert orphans and all((SHM_DIR / n).stat().st_mode & 0o777 == 0o600 for n in orphans), orphans
    live = SHM_DIR / f"{PREFIX_HEAD}{owner_tag()}_00000000_live"  # a live owner's (this process)
    live.write_bytes(b"x")
    server = TritonServer(REPO_ROOT / "model_repository", env=env, log_path=tmp_path / "server.log",
                          extra_args=["--model-control-mode=explicit", f"--load-model={MODEL}"])
    try:
        with server:
            assert regions(prefix) == [] and live.exists()
            pid = server.process.pid
            kill_own_stub(pid, model_stubs(pid, MODEL)[0])
            client = grpcclient.InferenceServerClient(server.grpc_url)
            force_reload(client, MODEL)  # a fresh stub and region next to the dead one's
            client.close()
            left = [p.name for p in regions(server.shm_prefix)]
            assert len(left) >= 2, left
            assert all((SHM_DIR / n).stat().st_mode & 0o777 == 0o600 for n in left), left
            os.kill(pid, signal.SIGKILL)
            server.process.wait(timeout=30)
    finally:
        live.unlink(missing_ok=True)
    assert regions(server.shm_prefix) == []
    assert set(left) <= set(server.removed_regions)
    assert all(name.startswith(server.shm_prefix) for name in server.removed_regions)
