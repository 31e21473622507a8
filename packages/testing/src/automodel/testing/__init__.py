"""automodel.testing: the test harness every package's tests share; dev-only, never in a wheel.

- `automodel.testing.ranks`: run a function on N forked gloo ranks (`run_on_ranks`), torchrun
  for GPU tests (`run_torchrun`), CUDA probes that never initialise CUDA here (`cuda_probe`).
- `automodel.testing.tiny_model`: the tiny seeded causal LMs (dense, GPT-2, the MoE families).
- `automodel.testing.moe`: the tiny MoE models of the expert-parallel tests and benchmarks.
- `automodel.testing.layout_table` / `layout_check`: the named layouts and the checker that fails
  a run whose layout was not applied (it reads `automodel.mesh.layout_report`'s reports).

Kept out of the published packages so that no wheel ships test code (`nox -s install_alone`
checks it). Importing this package imports nothing: each module is imported on its own.
"""
