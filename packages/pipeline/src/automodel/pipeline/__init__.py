"""Pipeline parallelism with every torch schedule; usable on its own."""
