"""Layout planning: per-rank memory estimates (activations included), step-time rooflines, the
search behind `recipes plan`, and the allocator measurement the estimates are tested against."""
