"""The classes DataParallelOptimizer is checked with: every dense functional class.

SparseAdam is left out: it steps only sparse gradients, which DataParallelOptimizer refuses
(it reduces dense buckets). Muon takes 2-D parameters only, so its model has no biases.
"""
import torch

#: (torch.optim class, keyword arguments): the model's second group runs at half the lr.
CASES = [
    (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3}),
    (torch.optim.Adam, {"lr": 1e-2}),
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    (torch.optim.Adagrad, {"lr": 0.05}),
    (torch.optim.Adadelta, {"lr": 1.0}),
    (torch.optim.Adamax, {"lr": 1e-2}),
    (torch.optim.RMSprop, {"lr": 1e-2, "momentum": 0.5}),
    (torch.optim.Rprop, {"lr": 1e-2}),
    (torch.optim.NAdam, {"lr": 1e-2}),
    (torch.optim.RAdam, {"lr": 1e-2}),
    (torch.optim.ASGD, {"lr": 1e-2}),
    (torch.optim.Adafactor, {"lr": 1e-2}),
    (torch.optim.Muon, {"lr": 1e-2}),
]

CASE_IDS = [cls.__name__ for cls, _ in CASES]
