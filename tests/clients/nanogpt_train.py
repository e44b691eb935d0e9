"""A client: a training script shaped like nanoGPT's train.py, written against stock DDP.

    torchrun --standalone --nproc_per_node=2 tests/clients/nanogpt_train.py runs/gpt

Not minddp code: tests/test_dropin.py runs it as it is and with its DDP import line swapped
for `from minddp import ManualDDP as DDP`, and compares the two runs bit for bit. What it
does as nanoGPT does: its own init_process_group and destroy_process_group (with the model
still alive), gradient accumulation through model.require_backward_grad_sync, autocast
bf16, a GradScaler, clip_grad_norm_, AdamW, and a checkpoint of model.module by rank 0.
"""

import math
import os
import sys

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed import init_process_group, destroy_process_group

vocab_size, block_size, n_embd, n_head, n_layer = 64, 16, 32, 2, 2
batch_size, gradient_accumulation_steps, max_iters = 4, 4, 6
learning_rate, min_lr, warmup_iters, grad_clip = 1e-2, 1e-3, 2, 1.0


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(self.ln_1(x)).split(n_embd, dim=2)
        q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block() for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, vocab_size),
                                                            targets.view(-1))
        return logits, loss


out_dir = sys.argv[1]
ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend="gloo")
    ddp_rank, ddp_local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    master_process = ddp_rank == 0
    seed_offset = ddp_rank
    gradient_accumulation_steps //= ddp_world_size
else:
    master_process, seed_offset, ddp_world_size = True, 0, 1
device = "cpu"
torch.manual_seed(1337 + seed_offset)
ctx = torch.autocast(device_type="cpu", dtype=torch.bfloat16)
data = torch.randint(vocab_size, (4096,), generator=torch.Generator().manual_seed(seed_offset))


def get_batch():
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x.to(device), y.to(device)


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    ratio = (it - warmup_iters) / (max_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


model = GPT().to(device)
scaler = torch.amp.GradScaler("cpu", enabled=False)  # nanoGPT: enabled only for float16
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.1)
if ddp:
    model = DDP(model, device_ids=[ddp_local_rank] if device.startswith("cuda") else None)
raw_model = model.module if ddp else model

X, Y = get_batch()
for iter_num in range(max_iters):
    for param_group in optimizer.param_groups:
        param_group["lr"] = get_lr(iter_num)
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        X, Y = get_batch()
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    print(f"rank {seed_offset} iter {iter_num}: loss {loss.item() * gradient_accumulation_steps!r}")

model.eval()
with torch.no_grad(), ctx:
    _, val_loss = model(*get_batch())
print(f"rank {seed_offset} val loss {val_loss.item()!r}")
if master_process:
    torch.save({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict()},
               os.path.join(out_dir, "ckpt.pt"))
if ddp:
    destroy_process_group()
