"""A real single-node Slurm, started for the tests from Debian's packages (``slurm`` fixture).

The fixture installs ``slurmctld slurmd slurm-client munge`` when they are missing (as root, with apt-get),
writes a private munge key and ``slurm.conf`` under a temporary directory, starts ``munged``, ``slurmctld``
and ``slurmd`` in the foreground on free ports, waits until ``sinfo`` shows the node idle, and stops them by
PID afterwards. Every Slurm command of a test runs with ``SLURM_CONF`` pointing at that file
(:attr:`SlurmCluster.env`), so nothing outside the temporary directory is touched.

What a container needs, and why:
``proctrack/linuxproc``, ``task/none`` and ``jobacct_gather/none`` (no cgroups);
the node's real CPU layout (``slurmd -C``, else the node is drained);
``cred_expire=10`` (a requeued job waits that long instead of 120 s before it may start again);
``EnforcePartLimits=ALL`` (an impossible request is refused by sbatch instead of pending forever);
short ``KillWait`` and scheduler intervals. No accounting database: submitit reads results from its own
pickles and ``sacct`` is only needed to notice jobs killed before writing one, which the sweep test avoids.

Where Slurm cannot run (not root, no apt-get, a daemon that fails) the fixture skips with the reason;
``HKRAG_REQUIRE_SLURM=1`` turns that skip into an error (for CI, where it must start).

Every wait follows the work, not the wall clock (:func:`wait_until`): it lasts as long as something moves (a job
changes state, a log grows, a file appears) and fails only after :data:`STALL` seconds without any change, or
:data:`CAP` seconds in all, saying what it was waiting for and what it last saw; a loaded machine makes a test
slower, not red.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo")
PARTITION = "hkrag"
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
            "PREEMPTED"}

SLURM_CONF = """\
ClusterName=hkragtest
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
AuthInfo=socket={root}/munge.socket,cred_expire=10
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1,batch_sched_delay=0,sched_min_interval=100000
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
EnforcePartLimits=ALL
KillWait=2
MinJobAge=600
InactiveLimit=0
Waittime=0
{node} State=UNKNOWN
PartitionName={partition} Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


STALL = 300.0
"""Seconds a wait accepts without progress (a job state changing, a log growing, a file appearing)."""
CAP = 1800.0
"""Seconds one wait may last in all, progress or not."""


class SlurmUnavailable(RuntimeError):
    """Slurm cannot be started here; the message says why."""


def wait_until(condition: Callable[[], Any], waiting_for: str, progress: Callable[[], Any], stall: float = STALL,
               cap: float = CAP, poll: float = 0.2) -> Any:
    """Poll ``condition`` until it returns a true value, and return that. ``progress()`` is a snapshot of what
    moves while the wait is worth continuing (job states, file sizes); a ``TimeoutError`` saying what it waited
    for and the last snapshot ends the wait when the snapshot has not changed for ``stall`` seconds, or after
    ``cap`` seconds in all."""
    start = changed = time.monotonic()
    seen = progress()
    while not (result := condition()):
        now, snapshot = time.monotonic(), progress()
        if snapshot != seen:
            seen, changed = snapshot, now
        if now - changed > stall or now - start > cap:
            why = f"no progress for {now - changed:.0f} s" if now - changed > stall else f"the {cap:.0f} s cap"
            raise TimeoutError(f"waited {now - start:.0f} s for {waiting_for} ({why}); last seen: {seen}")
        time.sleep(poll)
    return result


def file_sizes(*paths: Path) -> tuple:
    """What exists of ``paths`` and how big: a file's size, a folder's files and sizes, None for a missing path."""
    def stat_size(path: Path) -> int | None:
        try:
            return path.stat().st_size if path.is_file() else None
        except FileNotFoundError:  # renamed or removed while we looked (an atomic write's temporary file)
            return None

    def size(path: Path) -> Any:
        if path.is_dir():
            # os.walk skips vanished folders
            files = [Path(top, name) for top, _, names in os.walk(path) for name in names]
            sizes = ((str(f.relative_to(path)), stat_size(f)) for f in sorted(files))
            return tuple((name, n) for name, n in sizes if n is not None)
        return stat_size(path)
    return tuple(size(Path(path)) for path in paths)


@dataclass
class SlurmCluster:
    """A running single-node cluster: its files under ``root`` and the environment its commands need."""

    root: Path
    host: str
    version: str
    partition: str = PARTITION
    processes: list[subprocess.Popen] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """``os.environ`` with this cluster's ``SLURM_CONF`` (and no inherited job variables)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
        return {**env, "SLURM_CONF": str(self.root / "slurm.conf")}

    def command(self, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
                check: bool = True) -> subprocess.CompletedProcess:
        """Run a Slurm client command (``sbatch``, ``scontrol``, ...) against this cluster."""
        result = subprocess.run(args, env={**self.env, **(env or {})}, cwd=cwd, capture_output=True, text=True,
                                timeout=60)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def sbatch(self, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> int:
        """Submit a batch job; returns its id."""
        out = self.command("sbatch", "--parsable", *args, env=env, cwd=cwd).stdout.strip()
        return int(out.split(";")[0].split("_")[0])

    def job(self, job_id: int | str) -> dict[str, str]:
        """``scontrol show job`` fields of a job (the first task of an array)."""
        out = self.command("scontrol", "show", "job", "-o", str(job_id)).stdout.splitlines()[0]
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def states(self, job_id: int | str) -> list[str]:
        """Job states of a job, or of every task of an array."""
        out = self.command("scontrol", "show", "job", "-o", str(job_id)).stdout
        return re.findall(r"JobState=(\w+)", out)

    def progress(self, job_id: int | str, *watch: Path) -> tuple:
        """What moves while a job runs: its tasks' states and restart counts, the sizes of their logs and of
        ``watch`` (files or folders)."""
        out = self.command("scontrol", "show", "job", "-o", str(job_id)).stdout
        logs = [Path(path) for path in re.findall(r"StdOut=(\S+)", out)]
        return re.findall(r"JobState=(\w+)", out), re.findall(r"Restarts=(\d+)", out), file_sizes(*logs, *watch)

    def wait(self, job_id: int | str, *watch: Path, until: set[str] = FINISHED) -> list[str]:
        """Poll until every task of the job is in a state of ``until``, for as long as the job makes progress
        (:meth:`progress`, :func:`wait_until`); returns the states."""
        def reached() -> list[str] | None:
            states = self.states(job_id)
            return states if states and all(s in until for s in states) else None
        return wait_until(reached, f"job {job_id} to be {' or '.join(sorted(until))}",
                          lambda: self.progress(job_id, *watch), poll=0.5)

    def stop(self) -> None:
        """Cancel every job, stop the daemons (slurmd, slurmctld, munged) and remove their files."""
        if self.processes:
            self.command("scancel", "--partition", self.partition, check=False)
            time.sleep(1)
        for process in reversed(self.processes):
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()
        shutil.rmtree(self.root, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def install_packages() -> None:
    """Install Debian's Slurm and munge packages when missing (root with apt-get only)."""
    if all(shutil.which(c) or Path("/usr/sbin", c).exists() for c in COMMANDS):
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise SlurmUnavailable(f"Slurm is not installed and cannot be installed here (needs root and apt-get): "
                               f"apt-get install {' '.join(PACKAGES)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for args in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "--no-install-recommends",
                                                *PACKAGES]):
        result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise SlurmUnavailable(f"{' '.join(args)} failed: {result.stderr.strip()[-500:]}")


def _daemon(args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _tail(path: Path, lines: int = 8) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.is_file() else "(no log)"


def start_cluster(root: Path) -> SlurmCluster:
    """Write the configuration under ``root``, start the daemons and wait for the node to be idle (while their logs
    grow: :func:`_wait_for`)."""
    if os.geteuid() != 0:
        raise SlurmUnavailable("starting slurmctld/slurmd needs root")
    install_packages()
    host = socket.gethostname().split(".")[0]
    node = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30).stdout.splitlines()[0]
    version = subprocess.run(["slurmctld", "-V"], capture_output=True, text=True, timeout=30).stdout.strip()
    for sub in ("state", "spool"):
        (root / sub).mkdir(parents=True)
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    (root / "slurm.conf").write_text(SLURM_CONF.format(
        host=host, root=root, node=node, partition=PARTITION, ctld_port=free_port(), slurmd_port=free_port()))
    cluster = SlurmCluster(root=root, host=host, version=version)
    daemons = {
        "munged": ["munged", "-F", "--force", f"--socket={root}/munge.socket", f"--key-file={key}",
                   f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log", f"--seed-file={root}/munge.seed"],
        "slurmctld": ["slurmctld", "-D", "-i", "-f", str(root / "slurm.conf")],
        "slurmd": ["slurmd", "-D", "-N", host, "-f", str(root / "slurm.conf")],
    }
    try:
        for name, args in daemons.items():
            cluster.processes.append(_daemon(args, root / f"{name}.out"))
            if name == "munged":
                _wait_for(root, lambda: (root / "munge.socket").exists(), "munged's socket",
                          lambda: f"munged: {_tail(root / 'munged.log')}")
        _wait_for(root, lambda: _node_idle(cluster), "the node to be idle",
                  lambda: f"{_tail(root / 'slurmctld.log')}\n{_tail(root / 'slurmd.log')}")
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _node_idle(cluster: SlurmCluster) -> bool:
    dead = [p.args[0] for p in cluster.processes if p.poll() is not None]
    if dead:
        raise SlurmUnavailable(f"{dead} exited: {_tail(cluster.root / f'{dead[0]}.log')}")
    result = cluster.command("sinfo", "-h", "-N", "-o", "%t", check=False)
    return result.returncode == 0 and result.stdout.strip() == "idle"


def _wait_for(root: Path, condition: Callable[[], Any], waiting_for: str, logs: Callable[[], str]) -> None:
    """:func:`wait_until` while the daemons' logs under ``root`` grow; :class:`SlurmUnavailable` with their tails
    when they stall."""
    try:
        wait_until(condition, waiting_for, lambda: file_sizes(*sorted(root.glob("*.log")), *sorted(root.glob("*.out"))),
                   stall=60, poll=0.1)
    except TimeoutError as error:
        raise SlurmUnavailable(f"{error}\n{logs()}") from error


@pytest.fixture(scope="session")
def slurm() -> Iterator[SlurmCluster]:
    """A running single-node Slurm (see the module docstring); skips where it cannot start."""
    root = Path(tempfile.mkdtemp(prefix="hkrag-slurm-"))
    try:
        cluster = start_cluster(root)
    except (SlurmUnavailable, OSError, subprocess.SubprocessError) as error:
        shutil.rmtree(root, ignore_errors=True)
        if os.environ.get("HKRAG_REQUIRE_SLURM") == "1":
            raise
        pytest.skip(f"no Slurm: {error}")
    yield cluster
    cluster.stop()
