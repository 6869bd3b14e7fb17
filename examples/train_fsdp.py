"""Train a small transformer sharded with FSDP2, checkpoint it with ckptmgr, resume on restart.

Runs on CPU with the gloo backend, two processes::

    torchrun --nproc-per-node 2 examples/train_fsdp.py --steps 8    # saves steps 3 and 6
    torchrun --nproc-per-node 2 examples/train_fsdp.py --steps 12   # resumes at step 7

Every rank runs this same script. The model's parameters and AdamW's state are DTensors: each rank
holds a shard. ckptmgr saves them through ``torch.distributed.checkpoint``, so each rank writes
its own shards, and rank 0 commits the step once every rank has written. Because the optimizer
state is keyed by parameter names, the same checkpoint also restores with another number of
ranks (``--nproc-per-node 1``). On GPUs, use the ``nccl`` backend and a ``cuda`` device mesh.

Each run prints the step it resumed from, the loss of every step (averaged over the ranks), the
steps it saved and the committed steps at the end. The batches depend only on the step and the
rank, so a resumed run repeats the losses of the run it resumes, bit for bit.
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ckptmgr import CheckpointManager, StateDict

VOCAB, DIM, HEADS, SEQ, LAYERS, BATCH = 64, 32, 4, 16, 2, 8


class Block(nn.Module):
    """A pre-norm transformer layer: causal self-attention, then an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, seq, 3, HEADS, DIM // HEADS).unbind(2)
        attn = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, DIM))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """Embeddings, ``LAYERS`` blocks and an output head: a next-token model."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batch(step: int, rank: int) -> torch.Tensor:
    """This rank's tokens for ``step``: a repeating pattern with noise, so the loss goes down."""
    gen = torch.Generator().manual_seed(10_000 * rank + step)
    start = torch.randint(VOCAB, (BATCH, 1), generator=gen)
    tokens = (start + torch.arange(SEQ + 1) * 3) % VOCAB
    noise = torch.rand(BATCH, SEQ + 1, generator=gen) < 0.1
    return torch.where(noise, torch.randint(VOCAB, (BATCH, SEQ + 1), generator=gen), tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="checkpoints/fsdp", help="checkpoint path or URL")
    parser.add_argument("--steps", type=int, default=20, help="train up to this step")
    parser.add_argument("--save-every", type=int, default=3, help="save every N steps")
    parser.add_argument(
        "--storage-options",
        type=json.loads,
        default={},
        help='fsspec options as JSON, e.g. \'{"project": "my-project"}\' for gs://',
    )
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,))

    torch.manual_seed(0)  # the same initial weights on every rank before sharding
    model = TinyTransformer()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    progress = StateDict(step=0)
    # Module and Optimizer objects go in as they are: ckptmgr saves them with DCP's
    # get_model_state_dict/get_optimizer_state_dict (sharded, keyed by parameter names).
    state = {"model": model, "optimizer": optimizer, "progress": progress}

    def say(message: str) -> None:
        if rank == 0:
            print(message, flush=True)

    with CheckpointManager(
        args.dir,
        save_interval=args.save_every,
        max_to_keep=2,
        storage_options=args.storage_options,
    ) as mgr:
        latest = mgr.latest_step()
        if latest is None:
            say(f"starting fresh, world size {world_size}")
        else:
            mgr.restore(latest, state)  # every rank loads its own shards
            say(f"resumed from step {latest}, world size {world_size}")

        for step in range(progress.step + 1, args.steps + 1):
            tokens = batch(step, rank)
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            progress.step = step

            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            say(f"step {step} loss {mean_loss.item() / world_size!r}")
            # Returns once this rank's shards are copied to host memory; the write runs in the
            # background while training goes on.
            if mgr.save_async(step, state):
                say(f"saving step {step}")
        mgr.join()
        say(f"committed steps: {mgr.all_steps()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
