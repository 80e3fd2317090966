"""The model side of one worker: configs and checkpoint loaders (Hugging Face, GGUF), the
decoder and its mixture-of-experts layers, the attention backends (torch, CPU C, Triton),
the paged KV tensors, CUDA graphs, the sampler, and the runner that executes one
scheduled step."""
