"""The config layer: every YAML section as a typed, frozen dataclass, validated on construction.

A leaf: its modules import only each other, `automodel.recipes.errors` and `automodel.mesh` (dtype
names), and read no disk. What needs this machine (a directory exists, a file's rows parse) is
checked before launch (`launch_check.check_launch`); what needs behaviour (a ``_target_`` class,
the Hub cache) is resolved by the parser, `recipe_config.parse_recipe_config`.
"""
