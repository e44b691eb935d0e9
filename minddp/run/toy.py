"""The lesson's toy problem: five 2-D points in two classes, a 3-layer MLP, accuracy.

    python -c "from minddp.toy import toy_datasets; print(toy_datasets()[0].features)"

Small enough to read every number, which is the point: with 5 training examples,
batch size 2 and 2 ranks, you can check by hand which rank saw which example.
"""

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

X_TRAIN = torch.tensor([[-1.2, 3.1], [-0.9, 2.9], [-0.5, 2.6], [2.3, -1.1], [2.7, -1.5]])
Y_TRAIN = torch.tensor([0, 0, 0, 1, 1])
X_TEST = torch.tensor([[-0.8, 2.8], [2.6, -1.6]])
Y_TEST = torch.tensor([0, 1])


class ToyDataset(Dataset):
    """The lesson's dataset: (features, label) pairs from two tensors."""

    def __init__(self, X, y):
        """Examples X (one row each) with their class labels y."""
        self.features = X
        self.labels = y

    def __getitem__(self, index):
        return self.features[index], self.labels[index]

    def __len__(self):
        return self.labels.shape[0]


class NeuralNetwork(torch.nn.Module):
    """The lesson's model: three Linear layers with ReLU between them."""

    def __init__(self, num_inputs, num_outputs):
        """The lesson's MLP: num_inputs -> 30 -> 20 -> num_outputs, ReLU between."""
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(num_inputs, 30),
            torch.nn.ReLU(),
            torch.nn.Linear(30, 20),
            torch.nn.ReLU(),
            torch.nn.Linear(20, num_outputs),
        )

    def forward(self, x):
        """Logits, one row per example."""
        return self.layers(x)


def toy_datasets(factor=1):
    """(train, test) datasets; factor > 1 is the lesson's enlargement for up to 8 ranks.

    The enlargement draws noise from the global RNG, as the lesson does, so call it after
    torch.manual_seed and before building the model: every rank then draws the same
    noise, and the model's initial weights depend on factor exactly as in the lesson.
    """
    X_train, y_train = X_TRAIN, Y_TRAIN
    if factor > 1:
        X_train = torch.cat([X_train + torch.randn_like(X_train) * 0.1 for _ in range(factor)])
        y_train = y_train.repeat(factor)
    return ToyDataset(X_train, y_train), ToyDataset(X_TEST, Y_TEST)


def compute_accuracy(model, dataloader, device):
    """The lesson's accuracy: the fraction correct over what *this rank's* loader yields.

    No communication: with a sharded loader each rank gets the accuracy of its own shard.
    """
    correct, total = _count_correct(model, dataloader, device)
    return (correct / total).item()


def all_reduce_accuracy(model, dataloader, device):
    """The accuracy over the whole dataset, the same number on every rank.

    Collective: call on every rank.
    A sharded loader's counts are summed over ranks (all_reduce) before dividing, so
    every rank returns one global number. Called under `if rank == 0:` it would leave
    rank 0 waiting for peers that never join.
    """
    counts = torch.stack(_count_correct(model, dataloader, device))
    if getattr(dataloader.sampler, "num_replicas", 1) > 1:
        dist.all_reduce(counts)  # shards differ per rank: add them up
    return (counts[0] / counts[1]).item()


def _count_correct(model, dataloader, device):
    model = model.eval()
    correct = torch.zeros((), device=device)
    total = torch.zeros((), device=device)
    for features, labels in dataloader:
        features, labels = features.to(device), labels.to(device)
        with torch.no_grad():
            logits = model(features)
        predictions = torch.argmax(logits, dim=1)
        correct += torch.sum(labels == predictions)
        total += len(labels)
    return correct, total
