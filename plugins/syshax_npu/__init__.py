"""syshax's NPU backend: the torch prefill engine on an Ascend NPU through torch_npu (built-in plugin)."""
