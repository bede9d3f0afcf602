"""What the machine that runs offers, for the few defaults that depend on it (precision, optimizer, data loaders).

Such defaults stay symbolic in the config (`bf16: auto`, `optimizer: auto`, `dataloader_num_workers: auto`) and are
decided where the run happens: a config validated on one machine may train on another (Ray workers, `--nproc`).
`hellbender validate` shows what each will be on the machine it runs on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache


@dataclass(frozen=True)
class Machine:
    cuda: bool  # a CUDA GPU is visible
    bf16: bool  # that GPU computes in bfloat16
    cpus: int

    def describe(self) -> str:
        if not self.cuda:
            return "no CUDA GPU"
        return "a CUDA GPU with bfloat16" if self.bf16 else "a CUDA GPU without bfloat16"


@cache
def this_machine() -> Machine:
    import torch

    cuda = torch.cuda.is_available()
    return Machine(cuda=cuda, bf16=cuda and torch.cuda.is_bf16_supported(), cpus=os.cpu_count() or 1)
