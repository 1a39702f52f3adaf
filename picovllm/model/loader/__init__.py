"""Loading a model: its checkpoint's tensors (or random ones of its shapes) into the model, in the
target dtype and on the target device (model_loader.py)."""
