"""Lesson 9.2: the training loop on one device, with the three new lines marked NEW.

    python examples/single_device.py                # cuda, else mps, else cpu
    python examples/single_device.py --device cpu

On any device it prints the lesson's numbers (Train Loss 0.75, 0.65, 0.44, 0.13, 0.03,
0.00): moving to a GPU changes where the arithmetic runs, not what it computes.
"""

from minddp.run.cli import ArgumentParser

parser = ArgumentParser(description=__doc__.split("\n\n")[0])  # flags first, before torch loads
parser.add_argument("--device", help="cuda, mps or cpu (default: the best this machine has)")
parser.add_argument("--epochs", type=int, default=3)
args = parser.parse_args()

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from minddp import NeuralNetwork, compute_accuracy, toy_datasets

train_ds, test_ds = toy_datasets()
torch.manual_seed(123)  # the earlier lessons' loader: shuffled, seeded
train_loader = DataLoader(dataset=train_ds, batch_size=2, shuffle=True, num_workers=0,
                          drop_last=True)
test_loader = DataLoader(dataset=test_ds, batch_size=2, shuffle=False)

torch.manual_seed(123)
model = NeuralNetwork(num_inputs=2, num_outputs=2)

# NEW: define a device, portably: a GPU when there is one, Apple silicon's mps, else the CPU.
device = torch.device(args.device or ("cuda" if torch.cuda.is_available()
                                      else "mps" if torch.backends.mps.is_available() else "cpu"))
# NEW: transfer the model to the device (in place: the optimizer below sees the moved weights).
model.to(device)

optimizer = torch.optim.SGD(model.parameters(), lr=0.5)

for epoch in range(args.epochs):
    model.train()
    for batch_idx, (features, labels) in enumerate(train_loader):
        # NEW: transfer the data to the device, every batch, to where the model lives.
        features, labels = features.to(device), labels.to(device)

        logits = model(features)
        loss = F.cross_entropy(logits, labels)

        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"Epoch: {epoch + 1:03d}/{args.epochs:03d}"
              f" | Batch {batch_idx:03d}/{len(train_loader):03d}"
              f" | Train Loss: {loss:.2f}")

model.eval()
print(f"device {device} | Training accuracy {compute_accuracy(model, train_loader, device)}"
      f" | Test accuracy {compute_accuracy(model, test_loader, device)}")
