"""Keep bench tests light on the shared 2-core machine."""
import torch

torch.set_num_threads(1)
