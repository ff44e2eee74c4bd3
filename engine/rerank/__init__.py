"""Cross-encoder reranking: the model, its runtimes (torch, ONNX, int8), pair tokens, cache, batching."""
