"""Shipping a trained model: a LoRA adapter merged into its base, streamed (`merge`), and GGUF export."""
