"""GPT-2 recipe: the model (:mod:`.model`) and the language-model loss (:mod:`.loss`)."""

from ftrain.recipes.gpt2.loss import lm_loss
from ftrain.recipes.gpt2.model import GPT, GPTConfig, init_weights

__all__ = ["GPT", "GPTConfig", "init_weights", "lm_loss"]
