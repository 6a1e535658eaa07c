"""Recipes: model + loss (+ data) definitions that sit on top of the ftrain library.

They live inside the ``ftrain`` package so that an installed, non-editable ftrain can
import them (``python -m ftrain +recipe=gpt2`` needs the GPT-2 model wherever it runs).
Each recipe is a plain subpackage; nothing here is imported by the core library.

- :mod:`ftrain.recipes.gpt2`: a readable nanoGPT-style GPT-2 and its LM loss.
- :mod:`ftrain.recipes.mlp_regression`: the smallest "bring your own model" example.
"""
