import torch

# Several test processes share 2 CPU cores: one intra-op thread each avoids oversubscription,
# which makes small matmuls ~50x slower under load.
torch.set_num_threads(1)
