"""Expert parallelism for Hugging Face mixture-of-experts models."""
