"""The llama.cpp shard backend: derived shard GGUFs and a llama.cpp context per shard (see backend.py)."""

# a Vulkan driver manifest path that does not exist: a node with no GPU to use points the Vulkan loader at it
# (node.memory.skip_gpu_drivers), so that llama.cpp loads no GPU driver (devices.why_no_gpu says so)
NO_VULKAN_DRIVER = "/nonexistent/ggufswarm-gpu-none.json"
