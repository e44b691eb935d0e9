"""Lesson 9.1: where a tensor lives, how to move it, and the mixed-device error.

    python examples/devices.py

Runs on any machine: it uses a GPU (cuda) or Apple silicon (mps) when there is one,
and the CPU otherwise.
"""

import torch

# The portable device line: the best device this machine has, decided in one place.
device = torch.device("cuda" if torch.cuda.is_available()
                      else "mps" if torch.backends.mps.is_available() else "cpu")
print("CUDA available:", torch.cuda.is_available())
print("MPS available: ", torch.backends.mps.is_available())
print("using device:  ", device)

# A new tensor lives on the CPU; its operations run where it lives.
tensor_1 = torch.tensor([1., 2., 3.])
tensor_2 = torch.tensor([4., 5., 6.])
print("\non the CPU:   ", tensor_1 + tensor_2, "| tensor_1.device =", tensor_1.device)

# .to() returns a copy on the other device (for a tensor; a module moves in place).
tensor_1, tensor_2 = tensor_1.to(device), tensor_2.to(device)
print(f"on {device}:", tensor_1 + tensor_2)

# Every tensor in one operation must live on one device. Without an accelerator the
# "meta" device (shapes only, no data) stands in for the GPU to show the same error.
other = device if device.type != "cpu" else torch.device("meta")
on_other = torch.tensor([1., 2., 3.]).to(other)
on_cpu = torch.tensor([4., 5., 6.])  # still on the CPU
try:
    print(on_other + on_cpu)
except RuntimeError as err:
    print(f"\n{other} + cpu -> RuntimeError: {err}")
    print("  the fix: move both to one device first, e.g. on_cpu.to(device);")
    print("  in training, move the model once and every batch:"
          " model.to(device), features.to(device)")
