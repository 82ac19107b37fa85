"""The model: its checkpoint, its layers and the tower that runs them, with nothing of sampling.

``checkpoint_config`` (the geometry read from ``config.json``), ``checkpoint`` (safetensors
loading, sharded or not), ``kv_cache`` (the KV prefix layouts and their checks), ``rope`` and
``embeddings`` (positions, patches, the image grid), ``layers`` and ``transformer`` (one decoder
layer, dense or MoE; the tower that embeds, runs the layers over a branch's prefix and predicts
the clean image), ``attention`` (attention over prefix + image, and which SDPA kernel runs it),
``quant`` (FP8 layer linears), ``lora`` (adapters merged into weights), ``adapters`` and
``adapter_store`` (adapters applied unmerged per request, their directory and LRU), ``cuda_graphs`` (the
layers as CUDA graphs), ``speed`` (a model's speed options: graphs, attention kernel, compile),
``gguf_blocks`` and ``gguf_checkpoint`` (GGUF files, their blocks dequantized per call),
``checkpoint_digest`` (a checkpoint's hash) and ``layer_offload`` (layers in host memory, streamed
to the GPU as they run).
It may import torch, safetensors and the package's foundation modules (``errors``, ``limits``,
``modes``, ``json_file``); nothing of sampling, engines or serving.
"""
