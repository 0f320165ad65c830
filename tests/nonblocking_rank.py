"""pretrain_gpt.py with collectives that never block the host, as under NCCL: `Work.wait()`
returns at once (NCCL's wait only orders the GPU stream), so a lost rank is never seen by a
collective raising on the host."""
import sys

import torch.distributed as dist

dist.Work.wait = lambda self, timeout=None: True

import pretrain_gpt  # noqa: E402

if __name__ == "__main__":
    sys.exit(pretrain_gpt.main())
