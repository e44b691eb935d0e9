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
    """Fraction of correct predictions over the whole dataset the loader covers.

    The lesson's version counts this rank's shard only, so each rank prints another
    training accuracy. Here a sharded loader's counts are summed over ranks first, so
    every rank returns the same, global number (rank 0 prints it once).
    """
    model = model.eval()
    counts = torch.zeros(2, device=device)  # [correct, total]
    for features, labels in dataloader:
        features, labels = features.to(device), labels.to(device)
        with torch.no_grad():
            logits = model(features)
        predictions = torch.argmax(logits, dim=1)
        counts[0] += torch.sum(labels == predictions)
        counts[1] += len(labels)
    if getattr(dataloader.sampler, "num_replicas", 1) > 1:
        dist.all_reduce(counts)  # shards differ per rank: add them up
    return (counts[0] / counts[1]).item()
