"""The recipe model and its loader."""

from rlx.recipe.load import LoadedRecipe, load_recipe, parse_recipe
from rlx.recipe.model import Recipe

__all__ = ["LoadedRecipe", "Recipe", "load_recipe", "parse_recipe"]
