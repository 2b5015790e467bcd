"""The checkpoint file: its layout (zip skeleton, tensor extents, manifest), torch's pickle, safetensors."""
