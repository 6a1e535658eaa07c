"""A "bring your own model" example: a small MLP regressor, its loss and synthetic data."""

from ftrain.recipes.mlp_regression.model import MLP, make_data, mse_loss

__all__ = ["MLP", "make_data", "mse_loss"]
