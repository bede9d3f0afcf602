"""The memory and step-time planner (`hellbender plan`): a model of one training step's peak GPU memory, host memory
and time, computed from the model's structure on the meta device and the config, without weights or data.

One concern per module: `model_facts` (what the model holds), `settings` (the knobs of the run), `optimizers`
(optimizer state sizes), `activations` (saved tensors per layer and the loss), `distillation` (the teacher, its
targets and the distillation loss), `memory` (the per-GPU breakdown), `flops` and `cards` (step time), `fit` (the
verdict and the smallest change that fits), `report` (the text).
"""
