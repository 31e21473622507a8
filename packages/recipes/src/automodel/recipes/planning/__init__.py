"""Layout planning: per-rank memory estimates (activations included), step-time rooflines, the
search behind `recipes plan`, and the allocator measurement the estimates are tested against.

The package's `__init__` imports nothing: importing one of its modules (the value types of
`planning.step`, say) runs no other, so no import circle can pass through it. `recipes plan` is
`planning.propose.plan`.
"""
