"""`hellbender train --nproc N` (and the multi-node flags): start the same command in N processes per node with
torchrun, which sets up the process group's environment; the Trainer then trains with DDP over it.

Inside a launched process (`LOCAL_RANK` is set, as torchrun, `accelerate launch` and Ray set it) nothing is
launched again, so `torchrun ... -m hellbender train config.yml` works as well.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Launch:
    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    @property
    def needed(self) -> bool:
        return (self.nproc > 1 or self.nnodes > 1) and "LOCAL_RANK" not in os.environ

    def command(self, hellbender_args: list[str]) -> list[str]:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={self.nproc}",
            f"--nnodes={self.nnodes}",
            f"--node_rank={self.node_rank}",
            f"--master_addr={self.master_addr}",
            f"--master_port={self.master_port}",
            "-m",
            "hellbender",
            *hellbender_args,
        ]

    def run(self, hellbender_args: list[str]) -> int:
        """Run the processes and return torchrun's exit code. SIGTERM / SIGINT are passed on to torchrun, which
        passes them to every process, so a preempted multi-process run saves its checkpoint like a single one."""
        child = subprocess.Popen(self.command(hellbender_args))
        previous = {
            s: signal.signal(s, lambda signum, _: child.send_signal(signum)) for s in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            return child.wait()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
