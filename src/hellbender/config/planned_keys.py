"""Keys whose `auto` value the memory planner (`hellbender.plan.auto`) resolves while the config is read."""

AUTO_KEYS = ("micro_batch_size", "gradient_checkpointing", "gradient_checkpointing_layers")
