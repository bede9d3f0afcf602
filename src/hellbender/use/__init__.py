"""Using what was trained: merge the adapter into a standalone model, generate with it, evaluate it."""
