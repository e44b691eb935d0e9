"""Lesson 9.3's full DDP script (DDP-script-torchrun.py), copied from the lesson text.

The reference the examples are checked against: only the lines marked PATCHED changed,
so that it runs on CPU with gloo (the lesson's script is GPU-only). Run by the tests as

    torchrun --standalone --nproc_per_node=2 tests/reference/lesson_ddp_script.py
"""

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, DataLoader

DEVICE = "cpu"  # PATCHED: the tests run on CPU

# NEW imports:
import os
import platform
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed import init_process_group, destroy_process_group


# NEW: initialize a distributed process group (1 process / GPU)
def ddp_setup(rank, world_size):
    # Only set MASTER_ADDR and MASTER_PORT if not defined by torchrun
    if "MASTER_ADDR" not in os.environ:
        os.environ["MASTER_ADDR"] = "localhost"
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = "12345"

    if platform.system() == "Windows":
        os.environ["USE_LIBUV"] = "0"
        init_process_group(backend="gloo", rank=rank, world_size=world_size)
    else:
        init_process_group(backend="gloo", rank=rank, world_size=world_size)  # PATCHED: gloo, not nccl

    # PATCHED: no torch.cuda.set_device(rank) on CPU


class ToyDataset(Dataset):
    def __init__(self, X, y):
        self.features = X
        self.labels = y

    def __getitem__(self, index):
        return self.features[index], self.labels[index]

    def __len__(self):
        return self.labels.shape[0]


class NeuralNetwork(torch.nn.Module):
    def __init__(self, num_inputs, num_outputs):
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(num_inputs, 30),
            torch.nn.ReLU(),
            torch.nn.Linear(30, 20),
            torch.nn.ReLU(),
            torch.nn.Linear(20, num_outputs),
        )

    def forward(self, x):
        return self.layers(x)


def prepare_dataset():
    X_train = torch.tensor([
        [-1.2,  3.1], [-0.9,  2.9], [-0.5,  2.6],
        [ 2.3, -1.1], [ 2.7, -1.5]
    ])
    y_train = torch.tensor([0, 0, 0, 1, 1])
    X_test = torch.tensor([[-0.8, 2.8], [2.6, -1.6]])
    y_test = torch.tensor([0, 1])

    # Uncomment to enlarge the dataset for up to 8 GPUs:
    # factor = 4
    # X_train = torch.cat([X_train + torch.randn_like(X_train) * 0.1 for _ in range(factor)])
    # y_train = y_train.repeat(factor)

    train_ds = ToyDataset(X_train, y_train)
    test_ds  = ToyDataset(X_test, y_test)

    train_loader = DataLoader(
        dataset=train_ds, batch_size=2, shuffle=False,
        pin_memory=True, drop_last=True,
        sampler=DistributedSampler(train_ds)   # NEW
    )
    test_loader = DataLoader(dataset=test_ds, batch_size=2, shuffle=False)
    return train_loader, test_loader


def main(rank, world_size, num_epochs):
    ddp_setup(rank, world_size)

    train_loader, test_loader = prepare_dataset()
    model = NeuralNetwork(num_inputs=2, num_outputs=2)
    model.to(DEVICE)  # PATCHED: DEVICE, not rank
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)

    model = DDP(model, device_ids=None)   # PATCHED: device_ids=None on CPU

    for epoch in range(num_epochs):
        train_loader.sampler.set_epoch(epoch)   # NEW: reshuffle
        model.train()
        for features, labels in train_loader:
            features, labels = features.to(DEVICE), labels.to(DEVICE)  # PATCHED
            logits = model(features)
            loss = F.cross_entropy(logits, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            print(f"[GPU{rank}] Epoch: {epoch+1:03d}/{num_epochs:03d}"
                  f" | Batchsize {labels.shape[0]:03d}"
                  f" | Train/Val Loss: {loss:.4f}")  # PATCHED: 4 decimals

    model.eval()

    train_acc = compute_accuracy(model, train_loader, device=DEVICE)  # PATCHED
    print(f"[GPU{rank}] Training accuracy", train_acc)
    test_acc = compute_accuracy(model, test_loader, device=DEVICE)  # PATCHED
    print(f"[GPU{rank}] Test accuracy", test_acc)

    destroy_process_group()   # NEW


def compute_accuracy(model, dataloader, device):
    model = model.eval()
    correct = 0.0
    total_examples = 0
    for idx, (features, labels) in enumerate(dataloader):
        features, labels = features.to(device), labels.to(device)
        with torch.no_grad():
            logits = model(features)
        predictions = torch.argmax(logits, dim=1)
        correct += torch.sum(labels == predictions)
        total_examples += len(labels)
    return (correct / total_examples).item()


if __name__ == "__main__":
    if "WORLD_SIZE" in os.environ:
        world_size = int(os.environ["WORLD_SIZE"])
    else:
        world_size = 1

    if "LOCAL_RANK" in os.environ:
        rank = int(os.environ["LOCAL_RANK"])
    elif "RANK" in os.environ:
        rank = int(os.environ["RANK"])
    else:
        rank = 0

    if rank == 0:   # print only on rank 0
        print("PyTorch version:", torch.__version__)
        print("CUDA available:", torch.cuda.is_available())
        print("Number of GPUs available:", torch.cuda.device_count())

    torch.manual_seed(123)
    num_epochs = 3
    main(rank, world_size, num_epochs)
